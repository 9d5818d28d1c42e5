"""Every config field changes what the run builds or does: a field that does nothing fails by name.

The dynamic half of the config-field check (issue 22); `test_config_fields.py` is the static half
(the source reads every field somewhere). For each leaf field a non-default valid value (`VALUES`,
or `mutation`'s rule: flip a bool, the next Literal choice, another number) is set on this test's
base config (`BASE`, a short cheap run; `CONTEXT` adds what a field acts under, on both sides). The
result must pass `load_config`'s validation, and its effects (`Effects(cfg)`) must differ from the
base's. They come from the production builders and components, run in this process on tiny fixed
inputs with no Ray, Megatron or vLLM started (vLLM is imported for `debug.forced_first_turn` only).
The probes, cheapest first (a field is decided by the first that differs):

- `plan`: `make_plan`; `cadence`: the steps `Validator.due` and `Saver.due` act after;
- `build_options`, `optimizer` (`optimizer_config`, `scheduler_options`): what the Megatron ranks build;
- `critic`: the critic's optimizer, schedule, epochs (`CriticUpdate.run`) and value loss on a fixed batch;
- `engine` (`engine_kwargs`), `agent_loop` (`agent_loop_config`), `tools` (`build_toolset`, its tools
  called on fixed inputs or, for `python`, their limits);
- `update`: `ppo_update`'s `PPOUpdate` (its micro-batches and objective on a fixed batch); `guard`: its
  `StepGuard` fed fixed statistics over five optimizer steps; `kl`: `kl_controller` after fixed KLs;
- `drills`: the `Drills` hook points (NaN target, engine kill, holds, forced first turn);
- `sync`: the `WeightSender` built and connected to stand-in engines (a real `WeightReceiver` each);
- `run`: `Run(cfg).train()` whole, with Ray, the Megatron ranks and the vLLM engine stood in for
  (`FakeCluster`): the real `Trainer`, RL loop, `RolloutWorker` with its agent loop and tools,
  checkpoints' rotation, resume, SFT warm start and `RunLogger`. Its effect is what the workers are
  asked (every call and argument), the metrics, the files of the run and what it prints.

GPU_ONLY lists the fields that only take effect on a GPU (checked to change nothing here).
The tables are in `effects_values.py`, the probes in `effects_probes.py`, the stand-in cluster of
the `run` probe in `stand_in_run.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_agent.config import ConfigError, load_config, make_plan
from tests.config.effects_probes import (
    probe_agent_loop,
    probe_build_options,
    probe_cadence,
    probe_critic,
    probe_drills,
    probe_engine,
    probe_guard,
    probe_kl,
    probe_optimizer,
    probe_plan,
    probe_sync,
    probe_tools,
    probe_update,
)
from tests.config.effects_values import BASE, CONTEXT, FIELDS, GPU_ONLY, VALUES, mutation, overrides_of
from tests.config.stand_in_run import _summary, _write_checkpoint, run_effects

PROBES = [
    ("plan", probe_plan),
    ("cadence", probe_cadence),
    ("build_options", probe_build_options),
    ("optimizer", probe_optimizer),
    ("critic", probe_critic),
    ("engine", probe_engine),
    ("agent_loop", probe_agent_loop),
    ("kl", probe_kl),
    ("update", probe_update),
    ("guard", probe_guard),
    ("sync", probe_sync),
    ("drills", probe_drills),
    ("tools", probe_tools),
    ("run", lambda cfg, plan, env: run_effects(cfg, env)),
]


# --------------------------------------------------------------------------------- the check
@contextlib.contextmanager
def _isolated(folder: Path):
    """Run in `folder` from fixed RNG seeds on one thread (tiny tensors: threads only cost); the
    process's RNG states, thread count and directory come back."""
    states, threads = (
        (random.getstate(), np.random.get_state(), torch.get_rng_state()),
        torch.get_num_threads(),
    )
    folder.mkdir(parents=True, exist_ok=True)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    torch.set_num_threads(1)
    try:
        with contextlib.chdir(folder):
            yield
    finally:
        random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])
        torch.set_num_threads(threads)


class Effects:
    """What the run builds and does with one config, probe by probe, each computed on first use."""

    def __init__(self, overrides: list[str], folder: Path, env: dict):
        self.cfg = load_config(None, overrides)  # the mutated config must pass validation
        self.plan = make_plan(self.cfg)
        self.folder, self.env, self.values = folder, env, {}

    def __getitem__(self, name: str):
        if name not in self.values:
            probe = dict(PROBES)[name]
            with _isolated(self.folder / name):  # each probe in a folder of its own
                try:
                    value = probe(self.cfg, self.plan, self.env)
                except Exception as exc:  # noqa: BLE001 - raising is what the run does with it
                    value = f"raises {type(exc).__name__}: {exc}"
            self.values[name] = _summary(value)
        return self.values[name]

    def all(self) -> dict:
        """Every probe's value (`effects(cfg)`)."""
        return {name: self[name] for name, _ in PROBES}


class Lab:
    """The module's files and the base configs' effects (cached: one per context)."""

    def __init__(self, root: Path, files: dict[str, str]):
        self.root, self.files, self.bases, self.num = root, files, {}, 0
        self.env = {"files": files, "tiny": ({}, root)}

    def effects(self, overrides: list[str]) -> Effects:
        self.num += 1
        return Effects(overrides, self.root / f"config_{self.num}", self.env)

    def base(self, overrides: list[str]) -> Effects:
        key = tuple(overrides)
        if key not in self.bases:
            self.bases[key] = self.effects(overrides)
        return self.bases[key]


def first_difference(field: str, lab: Lab) -> str | None:
    """The first probe whose value differs between the base and the mutated config of `field`."""
    base, mutated = overrides_of(field, lab.files)
    try:
        changed = lab.effects(mutated)
    except ConfigError as exc:
        raise AssertionError(
            f"config field {field}: the test's value {mutated[-1]!r} is refused at load: {exc}"
        ) from None
    default = lab.base(base)
    return next((name for name, _ in PROBES if default[name] != changed[name]), None)


def assert_field_acts(field: str, lab: Lab) -> None:
    """Fail naming `field` when its value changes nothing the run builds or does."""
    if first_difference(field, lab) is None:
        raise AssertionError(
            f"config field {field} changes nothing the run builds or does (probes: "
            f"{', '.join(n for n, _ in PROBES)}): read it where its docstring says, or remove it"
        )


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    """Files the values name (a model, task and SFT files, a search index, checkpoints) and the cache."""
    from megatron_agent.data import synthetic
    from megatron_agent.data.sft import synthetic_calculator_demos, write_sft_rows
    from megatron_agent.data.tasks import write_tasks
    from megatron_agent.envs.tools.search import build_search_index
    from megatron_agent.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("effects")
    files = {
        "model": str(make_tiny_model(root / "model", "llama", seed=3)),
        "train_tasks": str(write_tasks(root / "train.jsonl", synthetic.arithmetic_tasks(4, seed=99))),
        "val_tasks": str(write_tasks(root / "val.jsonl", synthetic.arithmetic_tasks(2, seed=98))),
        "sft_rows": str(write_sft_rows(root / "sft.jsonl", synthetic_calculator_demos(6, 3))),
        "init_from": str(root / "init_from"),
        "critic_init_from": str(root / "critic_init_from"),
        "blocked": str(root / "blocked"),  # a file: no checkpoint folder can be made under it
        "checkpoints": str(root / "checkpoints"),
    }
    passages, _ = synthetic.multihop_corpus(4, seed=5)
    (root / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    files["search_index"] = str(build_search_index(root / "corpus.jsonl", root / "index"))
    _write_checkpoint(files["init_from"], {"sft_steps": 2})
    _write_checkpoint(files["critic_init_from"], {"step": 4, "run_state": True}, critic=True)
    Path(files["blocked"]).write_text("not a folder")
    lab = Lab(root, files)
    # A run to resume from: two steps, saved after each (checkpoints/step_000001 and _000002).
    saved = lab.effects(
        [*BASE, "trainer.total_steps=2", "checkpoint.save_freq=1", f"checkpoint.save_dir={root}/checkpoints"]
    )
    assert saved["run"]["status"] == 0, saved["run"]
    return lab


@pytest.mark.parametrize("field", [f for f in FIELDS if f not in GPU_ONLY])
def test_every_field_changes_what_the_run_builds_or_does(field, lab):
    assert_field_acts(field, lab)


@pytest.mark.parametrize("field", sorted(GPU_ONLY))
def test_gpu_only_fields_change_nothing_on_a_cpu(field, lab):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: these fields act here")
    try:
        difference = first_difference(field, lab)
    except AssertionError as exc:  # refused at load without a GPU
        assert "needs" in str(exc) and "GPU" in str(exc), exc
        return
    assert difference is None, f"{field} changes {difference!r} on this CPU: take it off GPU_ONLY"


def test_the_tables_name_fields_and_cover_each_one():
    assert set(GPU_ONLY) <= set(FIELDS) and set(VALUES) <= set(FIELDS) and set(CONTEXT) <= set(FIELDS)
    assert len(FIELDS) > 100
    for field in FIELDS:  # a value for every field (VALUES or the rule)
        mutation(field, BASE)


def test_the_effects_repeat_and_the_base_raises_nowhere(lab):
    # Otherwise a field that does nothing could pass: a second, uncached run of the base must agree.
    first, second = lab.base(BASE).all(), lab.effects(BASE).all()
    assert first == second, [name for name in first if first[name] != second[name]]
    assert not [name for name, v in first.items() if isinstance(v, str) and v.startswith("raises")]
    run = first["run"]
    assert run["status"] == 0, run
    (train,) = [call for call in run["calls"] if call[:2] == ["megatron", "train"]]
    batch = train[3][0]  # (group, method, ranks, args: batch, mini-batches, step)
    assert any(a != 0.0 for row in batch["tensors"]["advantages"] for a in row), "no advantage: rewards tie"
    assert any(c[:2] == ["rollout", "start_rollout"] for c in run["calls"]) and run["metrics"][1]["step"] == 1


def test_a_field_that_changes_nothing_fails_by_name(lab, monkeypatch):
    # The check can fail: with agent_loop_config ignoring rollout.top_p, that field is reported.
    from megatron_agent.rollout import factory

    real = factory.agent_loop_config
    monkeypatch.setattr(factory, "agent_loop_config", lambda cfg: dataclasses.replace(real(cfg), top_p=1.0))
    with pytest.raises(AssertionError, match=r"config field rollout\.top_p changes nothing"):
        assert_field_acts("rollout.top_p", lab)
    assert_field_acts("rollout.temperature", lab)  # the others still act
