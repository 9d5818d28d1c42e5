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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import io
import json
import logging
import os
import random
import re
import sys
import types
import typing
import zlib
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from megatron_agent.config import Config, ConfigError, load_config, make_plan
from megatron_agent.config.schema import KILL_PHASES
from megatron_agent.data.tasks import Task
from megatron_agent.rollout.trajectory import TokenSource, Trajectory
from megatron_agent.train.batch import RLBatch
from tests.config.test_config_fields import leaf_fields

# Fields that only take effect on a GPU (this test checks that each changes nothing on this CPU).
GPU_ONLY = {
    "model.fp8": "Transformer Engine FP8 recipes; every value but '' is refused at load without a GPU",
    "model.ref_offload": "moves the reference's weights off the GPU; MegatronModel.offload is a no-op on CPU",
    "rollout.colocate": "only decides whether engines get GPUs of their own (Trainer.start)",
    "rollout.quantization": "FP8 rollout weights; refused at load without a GPU",
    "sync.transport": "a Ray engine on a CPU host is reached by shm only (direct: in-process engines)",
    "sync.probe_tol_fp8": "the probe tolerance of FP8 engines (rollout.quantization=fp8, GPU only)",
}

# The base of every config here: a short, cheap run. Deterministic mode makes the stand-in engine's
# replies depend on per-request seeds only (not on the order tools finish in), so effects repeat.
BASE = [
    "trainer.total_steps=1",
    "trainer.deterministic=true",
    "data.train_batch_size=2",
    "data.num_synthetic_tasks=4",
    "data.num_synthetic_val_tasks=2",
    "rollout.n=2",
    "sft.num_synthetic=8",
    "sft.batch_size=4",
    "logging.plot=false",
]

# Chosen values; `mutation`'s rule gives the rest. Files ({...}: made once per module), values the
# rule cannot make (strings, lists), and numbers that must stay meaningful or act on the fixed inputs.
VALUES: dict[str, object] = {
    "model.path": "{model}",
    "model.transformer_impl": "local",
    "rollout.max_trajectory_seconds": 30.0,
    "rollout.max_engine_restarts": 0,
    "rollout.top_p": 0.9,
    "rollout.top_k": 5,
    "rollout.max_new_tokens": 4,
    "rollout.max_turns": 1,
    "rollout.max_total_tokens": 400,
    "rollout.gpu_memory_utilization": 0.8,
    "rollout.fp8_scales": "block128",
    "algorithm.clip_ratio_low": 0.1,
    "algorithm.clip_ratio_high": 0.1,
    "algorithm.clip_ratio_c": 1.5,
    "algorithm.kl_loss_coef": 0.1,
    "algorithm.kl_reward_coef": 0.1,
    "algorithm.entropy_coef": 0.01,
    "algorithm.log_ratio_clamp": 0.5,
    "algorithm.gamma": 0.5,
    "algorithm.loss_agg_horizon": 100,
    "algorithm.kl_reward_estimator": "k3",
    "algorithm.kl_target": 0.5,
    "algorithm.kl_horizon": 100,
    "algorithm.rollout_is": "token",
    "algorithm.rollout_is_cap": 1.01,
    "algorithm.mismatch_thresholds": [0.05],
    "algorithm.max_num_gen_batches": 1,
    "algorithm.overlong_buffer_len": 400,
    "algorithm.overlong_penalty_factor": 0.5,
    "algorithm.guard_max_abs_log_ratio": 0.5,
    "algorithm.guard_max_ratio": 1.5,
    "algorithm.guard_max_rollout_abs_log_ratio": 0.5,
    "algorithm.guard_max_abs_kl": 0.5,
    "algorithm.guard_max_grad_norm": 0.5,
    "algorithm.guard_top_k": 2,
    "algorithm.guard_max_consecutive_skips": 1,
    "actor.ppo_mini_batch_size": 1,
    "actor.micro_batch_tokens": 16,
    "actor.lr_warmup_steps": 2,
    "actor.min_lr": 1e-6,
    "actor.weight_decay": 0.01,
    "data.train_path": "{train_tasks}",
    "data.val_path": "{val_tasks}",
    "data.val_batch_size": 1,
    "data.max_prompt_length": 364,  # the base's synthetic prompts have 360 to 368 tokens
    "data.arithmetic_max_depth": 1,
    "tools.enabled": ["calculator", "python"],
    "tools.max_tool_response_tokens": 8,
    "tools.search_index_dir": "{search_index}",
    "tools.search_top_k": 1,
    "tools.python.sandbox": "off",
    "tools.python.memory_mb": 256,
    "sft.steps": 2,
    "sft.data_path": "{sft_rows}",
    "sft.num_synthetic": 6,
    "sft.tool_use_rate": 0.9,
    "sft.batch_size": 2,
    "sft.lr": 1e-3,
    "sft.warmup_steps": 1,
    "sft.min_lr_ratio": 0.5,
    "sync.probe_tol_fp32": 1e-3,
    "sync.probe_tol_bf16": 0.2,
    "sync.probe_tol_fp8": 0.25,
    "sync.transport": "shm",
    "trainer.run_dir": "runs/other",
    "trainer.test_freq": 1,
    "trainer.resume": "{checkpoints}/step_000001",
    "trainer.init_from": "{init_from}",
    "ray.address": "auto",
    "ray.num_cpus": 1,
    "checkpoint.save_dir": "ckpts",
    "checkpoint.keep_last": 1,
    "debug.nan_logits_step": 1,
    "debug.nan_logits_sample": 1,
    "debug.nan_logits_token": 1,
    "debug.forced_first_turn": "<answer>4</answer>",
    "debug.kill_engine_at_step": 1,
    "debug.hold_at": "update:1",
    "logging.wandb_project": "effects",
}

# Settings a field acts under, applied on both sides of its comparison.
CONTEXT: dict[str, list[str]] = {
    "parallel.vpp": ["parallel.pp=2"],
    "rollout.max_engine_restarts": ["debug.kill_engine_at_step=1"],
    "algorithm.kl_loss_estimator": ["algorithm.kl_loss_coef=0.1"],
    "algorithm.kl_reward_estimator": ["algorithm.kl_reward_coef=0.1"],
    "algorithm.kl_ctrl": ["algorithm.kl_reward_coef=0.1"],
    "algorithm.kl_target": ["algorithm.kl_ctrl=adaptive", "algorithm.kl_reward_coef=0.1"],
    "algorithm.kl_horizon": ["algorithm.kl_ctrl=adaptive", "algorithm.kl_reward_coef=0.1"],
    "algorithm.gamma": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "algorithm.loss_agg_horizon": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    "algorithm.rollout_is_cap": ["algorithm.rollout_is=token"],
    "algorithm.rollout_is_mode": ["algorithm.rollout_is=token", "algorithm.rollout_is_cap=1.01"],
    "algorithm.max_num_gen_batches": ["algorithm.dynamic_sampling=true"],
    "algorithm.overlong_penalty_factor": ["algorithm.overlong_buffer_len=400"],
    "algorithm.guard_top_k": ["algorithm.guard_max_abs_log_ratio=0.5"],
    "algorithm.guard_max_consecutive_skips": ["algorithm.guard_max_abs_log_ratio=0.5"],
    "actor.min_lr": ["actor.lr_decay=linear"],
    "tools.search_top_k": ["tools.enabled=[calculator,search]", "tools.search_index_dir={search_index}"],
    "tools.python.sandbox": ["tools.enabled=[calculator,python]"],
    "tools.python.memory_mb": ["tools.enabled=[calculator,python]"],
    "tools.python.max_processes": ["tools.enabled=[calculator,python]"],
    "sync.probe_tol_bf16": ["model.dtype=bf16"],
    "trainer.resume": ["trainer.total_steps=2"],  # resumes after step 1, then trains step 2
    "checkpoint.keep_last": ["trainer.total_steps=2", "checkpoint.save_freq=1"],
    "checkpoint.on_save_error": ["checkpoint.save_dir={blocked}/ckpts", "checkpoint.save_freq=1"],
    "debug.nan_logits_sample": ["debug.nan_logits_step=1"],
    "debug.nan_logits_token": ["debug.nan_logits_step=1"],
    **{
        f"sft.{name}": ["sft.steps=2", *(["sft.warmup_steps=0"] if name == "min_lr_ratio" else [])]
        for name in ("data_path", "num_synthetic", "tool_use_rate", "batch_size", "lr", "warmup_steps")
        + ("min_lr_ratio", "seed")
    },
}

FIELDS = {".".join((*path, name)): cls for path, name, cls in leaf_fields()}


# --------------------------------------------------------------------------------- values
def _field_type(dotted: str):
    return typing.get_type_hints(FIELDS[dotted])[dotted.rsplit(".", 1)[1]]


def _current(dotted: str, overrides: list[str]):
    """The field's value in the config of `overrides` (validation aside)."""
    obj = load_config(None, overrides, validate=False)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def mutation(dotted: str, base: list[str]):
    """A value of `dotted` other than its value in `base`: VALUES, or flip / next choice / another number."""
    if dotted in VALUES:
        return VALUES[dotted]
    typ, now = _field_type(dotted), _current(dotted, base)
    if typing.get_origin(typ) is typing.Literal:
        choices = typing.get_args(typ)
        return choices[(choices.index(now) + 1) % len(choices)]
    if typ is bool:
        return not now
    if typ is int:
        return now + 1 if now >= 0 else 1
    if typ is float:
        return now * 2 if now else 0.5
    raise AssertionError(f"{dotted}: no rule for a {typ} value; add one to VALUES")


def _text(value, files: dict[str, str]) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value).format(**files) if isinstance(value, str) else str(value)


def overrides_of(dotted: str, files: dict[str, str]) -> tuple[list[str], list[str]]:
    """(base, mutated) overrides of the comparison of `dotted`."""
    base = BASE + [o.format(**files) for o in CONTEXT.get(dotted, [])]
    value = mutation(dotted, base)
    return base, [*base, f"{dotted}={_text(value, files)}"]


# --------------------------------------------------------------------------------- inputs
def fixed_trajectories() -> list[Trajectory]:
    """Four scored trajectories of two groups, with sampled and tool tokens."""
    out = []
    for b in range(4):
        traj = Trajectory(uid=f"t{b // 2}/{b % 2}", prompt_ids=[5, 6, 7, 8, 9 + b], task_uid=f"t{b // 2}")
        traj.append([20 + b, 21, 22], TokenSource.SAMPLED, [-0.5, -1.0 - 0.1 * b, -0.2])
        traj.append([30, 31], TokenSource.TOOL)
        traj.append([40 + b, 41, 42 + b][: 2 + b % 2], TokenSource.SAMPLED, [-0.3, -1.5, -0.7][: 2 + b % 2])
        traj.reward = [1.0, 0.0, 0.1, 1.0][b]
        out.append(traj)
    return out


def fixed_batch():
    """The RL batch of `fixed_trajectories` with old/ref log-probs, advantages and IS weights."""
    from megatron_agent.train.batch import batch_from_trajectories

    batch = batch_from_trajectories(fixed_trajectories())
    g = torch.Generator().manual_seed(0)
    shape = batch.padded("loss_mask").shape
    rollout = batch.padded("rollout_logp")
    batch.set_padded("old_logp", rollout + 0.6 * torch.randn(shape, generator=g))
    batch.set_padded("ref_logp", rollout + 0.8 * torch.randn(shape, generator=g))
    batch.set_padded("advantages", torch.randn(shape, generator=g))
    batch.set_padded("is_weights", 0.5 + torch.rand(shape, generator=g))
    return batch


# --------------------------------------------------------------------------------- probes
def probe_plan(cfg, plan, env):
    return plan.to_dict()


def probe_cadence(cfg, plan, env):
    from megatron_agent.train.checkpointer import Saver
    from megatron_agent.train.run import Validator

    steps = range(0, cfg.trainer.total_steps + 4)
    validator, saver = Validator(cfg, None), Saver(cfg, None, None)
    return {"validate": [s for s in steps if validator.due(s)], "save": [s for s in steps if saver.due(s)]}


def probe_build_options(cfg, plan, env):
    from megatron_agent.train.megatron_worker import build_options

    return dataclasses.asdict(build_options(cfg))


def probe_optimizer(cfg, plan, env):
    from megatron_agent.train.megatron_worker import optimizer_config, scheduler_options

    return {
        "optim": dataclasses.asdict(optimizer_config(cfg)),
        "scheduler": scheduler_options(cfg, plan.total_optimizer_steps),
    }


def probe_engine(cfg, plan, env):
    from megatron_agent.rollout.factory import engine_kwargs

    return engine_kwargs(cfg, cache_dir=cfg.trainer.run_dir)  # what RolloutWorker passes


def probe_agent_loop(cfg, plan, env):
    from megatron_agent.rollout.factory import agent_loop_config

    return dataclasses.asdict(agent_loop_config(cfg))


@contextlib.contextmanager
def _no_sandbox_probes():
    """The python tool's probes of this machine (bubblewrap, `unshare -n`) answered without starting
    a process (the unit tier starts none): no sandbox here."""
    from megatron_agent.envs.tools import python

    with (
        mock.patch.object(python, "_probe", lambda bwrap: "not probed in the unit tier"),
        mock.patch.object(python, "network_namespace_available", lambda: False),
    ):
        yield


def probe_tools(cfg, plan, env):
    from megatron_agent.rollout.factory import build_toolset

    with _no_sandbox_probes():
        tools = build_toolset(cfg, plan.tools, plan.search_index_dir)
    calls = {"calculator": {"expression": "6 * 7"}, "search": {"query": "capital of Zorbia"}}
    out = {"timeout_s": tools.timeout_s, "schemas": tools.schemas()}
    for name, tool in tools.tools.items():
        if name in calls:
            out[name] = dataclasses.asdict(asyncio.run(tools.run(name, calls[name])))
            out[name].pop("seconds")
        else:  # the python tool runs snippets in processes: its limits
            keys = ("mode", "memory_mb", "max_processes", "timeout_s", "sandboxed")
            out[name] = {k: getattr(tool, k, None) for k in keys}
    return out


def _update(cfg, plan):
    from megatron_agent.train.megatron_worker import ppo_update

    return ppo_update(cfg, plan, None, None, console=False)


def probe_update(cfg, plan, env):
    update, batch = _update(cfg, plan), fixed_batch()
    names = ("old_logp", "ref_logp", "advantages", "is_weights")
    extras = {k: batch.padded(k) for k in names}
    mask = batch.padded("loss_mask").bool()
    g = torch.Generator().manual_seed(1)
    logp = extras["old_logp"] + 0.7 * torch.randn(mask.shape, generator=g)
    entropy = torch.rand(mask.shape, generator=g)
    loss, metrics = update.objective(
        extras, logp, entropy, mask, num_tokens=mask.sum().float(), num_seqs=float(len(batch))
    )
    return {
        "horizon": update.horizon,
        "chunk_tokens": update.chunk_tokens,
        "old_from_update": update.old_from_update,
        "micro_batches": [mb.indices for mb in update.micro_batches(batch, "cpu")],
        "loss": {"loss": loss, **metrics},
    }


def probe_guard(cfg, plan, env):
    from megatron_agent.rl import GuardBatch, GuardError

    guard, batch = _update(cfg, plan).guard, fixed_batch()
    mask = batch.padded("loss_mask").bool()
    old = batch.padded("old_logp")
    g = torch.Generator().manual_seed(2)
    out = []
    for step in range(5):
        logp = old + 0.4 * torch.randn(mask.shape, generator=g)
        guard.observe(
            GuardBatch(
                logprob=logp,
                old_logprob=old,
                advantages=batch.padded("advantages"),
                loss_mask=mask,
                rollout_logprob=torch.where(mask, batch.padded("rollout_logp"), float("nan")),
                ref_logprob=batch.padded("ref_logp"),
                sample_ids=batch.uids,
            )
        )
        try:
            d = guard.check(step, loss=[logp.sum()], grads=[torch.full((4,), 1.0)])
        except GuardError as exc:
            out.append(str(exc))
            break
        report = json.loads(d.report_path.read_text()) if d.report_path else None
        out.append({"skip": d.skip, "reasons": d.reasons, "metrics": d.metrics, "report": report})
    return out


def probe_kl(cfg, plan, env):
    from megatron_agent.train.trainer import kl_controller

    ctrl = kl_controller(cfg)
    values = [ctrl.value]
    for kl in (0.5, 0.0, 0.3):
        ctrl.update(kl, 4)
        values.append(ctrl.value)
    return {"kind": type(ctrl).__name__, "values": values}


class _Held(Exception):
    """Raised instead of sleeping forever at a kill point."""


class _Killed(Exception):
    """Raised instead of SIGKILL by the engine-kill drill."""


@contextlib.contextmanager
def _safe_drills():
    """The drills' endless sleep and SIGKILL made exceptions: nothing may hang or kill pytest."""
    from megatron_agent.train import fault_injection, kill_points

    def kill(pid, sig):
        raise _Killed(f"signal {sig}")

    def sleep(seconds):
        raise _Held()

    with (
        mock.patch.object(kill_points, "time", types.SimpleNamespace(sleep=sleep)),
        mock.patch.object(fault_injection, "os", types.SimpleNamespace(kill=kill, getpid=os.getpid)),
    ):
        yield


def probe_drills(cfg, plan, env):
    from megatron_agent.train.drills import DrillPlan, Drills
    from megatron_agent.train.fault_injection import nan_target

    drills, batch = Drills(DrillPlan.from_config(cfg)), fixed_batch()
    out: dict = {"nan": [nan_target(cfg.debug, batch, step) for step in (1, 2)]}
    killed = []
    for step in (1, 2):
        engine = types.SimpleNamespace(weight_version=step, step=lambda: [])
        real = engine.step
        with drills.around_rollout(engine, 0, False):
            killed.append(engine.step is not real)
    out["kill"] = killed
    Path(cfg.trainer.run_dir).mkdir(parents=True, exist_ok=True)
    held = []
    with _safe_drills():
        for phase in KILL_PHASES:
            for step in (1, 2):
                try:
                    drills.reached(phase, step)
                except _Held:
                    held.append(f"{phase}:{step}")
    out["held"] = held
    if cfg.debug.forced_first_turn:  # imports vLLM (rollout/scripted.py): only when set
        from transformers import AutoTokenizer

        hook = drills.turn_hook(AutoTokenizer.from_pretrained(env["files"]["model"]))
        out["turn_hook"] = hook(None, 0) if hook else None
        out["processors"] = [c.__name__ for c in drills.engine_logits_processors()]
    return out


class _StubEndpoint:
    """A Ray endpoint's interface (another process, this host) answering from a real `WeightReceiver`."""

    local = False

    def __init__(self, receiver):
        self.receiver, self.timeouts = receiver, []

    def call(self, method, *args, **kwargs):
        value, timeouts = self.receiver.handle(method, *args, **kwargs), self.timeouts

        class Call:
            def result(self, timeout=None):
                timeouts.append(timeout)
                return value

        return Call()


def probe_sync(cfg, plan, env):
    from megatron_agent.sync import WeightReceiver, WeightSender
    from megatron_agent.sync.producer import SyncRole
    from megatron_agent.train.megatron_worker import build_options, rollout_dtype

    engine = types.SimpleNamespace(weight_version=0, on_gpu=False, quantization=None)
    endpoint = _StubEndpoint(WeightReceiver(engine))
    model = types.SimpleNamespace(
        chunks=[torch.nn.Linear(4, 4)], opts=build_options(cfg), arch=types.SimpleNamespace(vocab_size=64)
    )
    role = SyncRole(0, 0, 1, True, True, True, True)
    with mock.patch.object(SyncRole, "current", classmethod(lambda cls: role)):
        sender = WeightSender(model, cfg.sync, [endpoint], rollout_dtype=rollout_dtype(cfg))
    sender._connect()  # what the first sync does: ask the engines, pick transports and checksums
    keys = ("bucket_bytes", "stage_bytes", "tol", "transports", "device", "algo", "quantizer")
    return {**{k: getattr(sender, k) for k in keys}, "timeouts": endpoint.timeouts}


PROBES = [
    ("plan", probe_plan),
    ("cadence", probe_cadence),
    ("build_options", probe_build_options),
    ("optimizer", probe_optimizer),
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


# --------------------------------------------------------------------------------- the run
def _fake_logp(sequence) -> torch.Tensor:
    """Fixed per-target log-probs of a sequence (the stand-in ranks' old and reference log-probs)."""
    return torch.tensor([-0.2 - 0.05 * (t % 5) for t in sequence[1:]], dtype=torch.float32)


def _write_checkpoint(final: str, meta: dict, driver: dict | None = None) -> None:
    """A complete checkpoint folder (staging, manifest, rename), as `save_checkpoint` publishes it."""
    from megatron_agent.checkpoint.manifest import write_manifest

    final_path = Path(final)
    staging = final_path.parent / f".{final_path.name}.tmp-fake"
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "weights").write_bytes(b"weights")
    if driver is not None:
        (staging / "trainer").mkdir()
        (staging / "trainer" / "driver.json").write_text(json.dumps(driver))
    (staging / "meta.json").write_text(json.dumps(meta))
    write_manifest(staging, fsync=False)
    if final_path.exists():
        import shutil

        shutil.rmtree(final_path)
    staging.rename(final_path)


class FakeRank:
    """A Megatron rank (`MegatronWorker`'s methods): fixed answers; checkpoints written to disk."""

    def __init__(self, rank, world_size, log_path, cfg_dict, plan_dict):
        from megatron_agent.config import RunPlan

        self.rank, self.world_size, self.plan = rank, world_size, RunPlan.from_dict(plan_dict)
        self.engines: list = []
        self.save_error = ""

    def rendezvous_address(self):
        return "127.0.0.1", 29500

    def setup(self, master_addr, master_port, init_from=""):
        return {"rank": self.rank, "dp_rank": 0, "dp_size": 1, "reports": self.rank == 0}

    def connect_engines(self, engines):
        self.engines = engines  # the fake group's RolloutWorker objects

    def close_sync(self):
        pass

    def make_update(self, total_optimizer_steps):
        pass

    def restart_from(self, ckpt_dir):
        pass

    def logprobs(self, sequences, with_old=True, with_ref=True):
        if self.rank:
            return None
        old = [_fake_logp(s) for s in sequences]
        return {
            "indices": list(range(len(sequences))),
            "old": old if with_old else None,
            "ref": [x * 1.5 for x in old] if with_ref else None,
            "entropy": [torch.full_like(x, 0.5) for x in old] if with_old else None,
            "timing_s/old_log_prob": 0.0,
            "timing_s/ref": 0.0,
        }

    def train(self, batch, mini_batch_indices, step):
        if self.rank:
            return None
        out = {
            "actor/pg_loss": 0.0,
            "n_tokens": float(sum(m.sum() for m in batch.tensors["loss_mask"])),
            "n_optimizer_steps": float(len(mini_batch_indices)),
            "actor/lr": 1e-5,
        }
        if self.plan.old_logprobs_from_update:
            old = [_fake_logp(s) for s in batch.sequences]
            out["captured"] = {
                "indices": list(range(len(batch))),
                "old": old,
                "entropy": [torch.full_like(x, 0.5) for x in old],
            }
        return out

    def sync_weights(self):
        if self.rank == 0:
            for worker in self.engines:  # each engine's `finish`: one version more
                worker.engine.weight_version += 1
        version = self.engines[0].engine.weight_version
        return {
            "sync/weight_version": float(version),
            "sync/verified": 1.0,
            "sync/probe_max_abs": 0.0,
            "sync/seconds": 0.0,
        }

    def sft_step(self, sequences, loss_masks, lr):
        return {"sft/loss": 1.0} if self.rank == 0 else None

    def save_checkpoint(self, ckpt_dir, hf_dir, extra_meta=None):
        if self.rank == 0:
            _write_checkpoint(ckpt_dir, dict(extra_meta or {}))
        return ckpt_dir

    def save_state(self, ckpt_dir, hf_dir, driver_state):
        self.save_error = ""
        try:
            Path(ckpt_dir).parent.mkdir(parents=True, exist_ok=True)
            if self.rank == 0:
                _write_checkpoint(ckpt_dir, {"step": driver_state["step"], "run_state": True}, driver_state)
        except OSError as exc:
            self.save_error = f"writing the checkpoint {ckpt_dir} failed on rank {self.rank}: {exc}"
            raise RuntimeError(self.save_error) from exc
        return ckpt_dir

    def last_save_error(self):
        return self.save_error

    def load_state(self, ckpt_dir):
        return int(json.loads((Path(ckpt_dir) / "meta.json").read_text())["step"])


class FakeEngine:
    """`VLLMEngine`'s interface: a reply per request picked by its seed (or arrival), each recorded."""

    REPLIES = (
        "<answer>4</answer>",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>',
        "I am not sure.",
    )

    def __init__(self, model_path, cluster, **kwargs):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.cluster, self.kwargs = cluster, kwargs
        self.weight_version, self._queue, self._count = 0, [], 0
        procs = [c.__name__ for c in kwargs.get("logits_processors", ())]
        cluster.record("engine", "start", {**kwargs, "logits_processors": procs})

    @property
    def eos_token_id(self):
        return int(self.tokenizer.eos_token_id)

    def add_request(self, prompt_ids, sampling):
        self._count += 1
        self.cluster.record("engine", "request", len(prompt_ids), dataclasses.asdict(sampling))
        self._queue.append((f"r{self._count}", list(prompt_ids), sampling))
        return f"r{self._count}"

    def step(self):
        """The oldest request, whole (like `HFEngine`)."""
        if not self._queue:
            return []
        rid, prompt, sampling = self._queue.pop(0)
        return [(rid, self._reply(prompt, sampling))]

    def _reply(self, prompt, sampling):
        from megatron_agent.rollout.engine import GenerationOutput

        eos = self.eos_token_id
        if sampling.extra_args:  # the forced-first-turn drill's script (scripted.py)
            from megatron_agent.rollout.scripted import FORCED_KEY

            ids = list(sampling.extra_args[FORCED_KEY]) + [eos]
        else:
            key = sampling.seed if sampling.seed is not None else self._count
            pick = 0 if sampling.temperature == 0 else zlib.crc32(f"{key}:{self.kwargs['seed']}".encode()) % 3
            ids = self.tokenizer.encode(self.REPLIES[pick], add_special_tokens=False) + [eos]
        finish, reason = "stop", None
        for i, t in enumerate(ids):
            if t in sampling.stop_token_ids:
                ids, reason = ids[: i + 1], t
                break
        if len(ids) > sampling.max_tokens:
            ids, finish, reason = ids[: sampling.max_tokens], "length", None
        logprobs = [-0.1 - 0.05 * (t % 7) for t in ids]
        return GenerationOutput(ids, logprobs, finish, reason, self.weight_version)

    def abort(self, request_ids):
        self._queue = [q for q in self._queue if q[0] not in request_ids]

    def has_unfinished_requests(self):
        return bool(self._queue)

    def reset_prefix_cache(self):
        self.cluster.record("engine", "reset_prefix_cache")


class _Done:
    def __init__(self, results, error):
        self.results, self.error = results, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.results


class FakeGroup:
    """`cluster.WorkerGroup` in this process: the same calls and errors; the workers are objects."""

    def __init__(self, cluster, actor_cls, num_workers, *, name, log_dir, init_args=(), **options):
        worker_cls = FakeRank if actor_cls.__name__ == "MegatronWorker" else actor_cls
        self.cluster, self.name = cluster, name
        self.make = lambda rank: worker_cls(rank, num_workers, f"{log_dir}/{name}_{rank}.log", *init_args)
        cluster.record(name, "start", num_workers, str(log_dir), options)
        self.workers = [self.make(rank) for rank in range(num_workers)]

    def __len__(self):
        return len(self.workers)

    def submit(self, method, *args, timeout_s=None, per_worker_args=None, ranks=None, **kwargs):
        from megatron_agent.train.cluster import WorkerDiedError, WorkerError

        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        self.cluster.record(self.name, method, ranks, args, kwargs, timeout_s)
        results = []
        for i, rank in enumerate(ranks):
            worker_args = per_worker_args[i] if per_worker_args is not None else args
            try:
                results.append(getattr(self.workers[rank], method)(*worker_args, **kwargs))
            except _Killed as exc:
                died = WorkerDiedError(f"{self.name} worker rank {rank} died during {method}(): {exc}", rank)
                return _Done(None, died)
            except Exception as exc:  # noqa: BLE001 - what WorkerGroup reports of a raising worker
                return _Done(
                    None, WorkerError(f"{self.name} worker rank {rank} raised in {method}(): {exc!r}")
                )
        return _Done(results, None)

    def call(self, method, *args, **kwargs):
        return self.submit(method, *args, **kwargs).result()

    def replace(self, rank):
        self.cluster.record(self.name, "replace", rank)
        self.workers[rank] = self.make(rank)
        return self.workers[rank]

    def kill(self):
        self.cluster.record(self.name, "kill")


_CONFIGS: dict[str, Config] = {}


def _config_from_dict_once(data: dict) -> Config:
    """`config_from_dict`, each distinct dict rebuilt once (it evaluates the schema's annotations
    per field: a third of a run here), then copied."""
    from megatron_agent.config import config_from_dict

    key = json.dumps(data, sort_keys=True)
    if key not in _CONFIGS:
        _CONFIGS[key] = config_from_dict(data)
    return copy.deepcopy(_CONFIGS[key])


class FakeCluster:
    """Ray, the worker groups and wandb of one run, in this process; records what the run asks of them."""

    def __init__(self):
        self.calls: list = []
        self.initialized = False

    def record(self, *what):
        self.calls.append(_summary(what))

    # the functions of `ray` the driver calls
    def init(self, **kwargs):
        self.record("ray", "init", kwargs)
        self.initialized = True

    def is_initialized(self):
        return self.initialized

    def shutdown(self):
        self.record("ray", "shutdown")
        self.initialized = False

    def cluster_resources(self):
        return {"CPU": 2.0}

    def wandb(self):
        cluster = self

        class Run:
            def define_metric(self, *args, **kwargs):
                pass

            def log(self, row):
                cluster.record("wandb", "log", row)

            def finish(self):
                cluster.record("wandb", "finish")

        def init(**kwargs):
            cluster.record("wandb", "init", {k: v for k, v in kwargs.items() if k != "settings"})
            return Run()

        module = types.ModuleType("wandb")
        module.init, module.Settings, module.teardown = init, lambda **kw: kw, lambda: None
        return module

    @contextlib.contextmanager
    def installed(self):
        """Ray, `WorkerGroup`, the engine and wandb replaced by this cluster's stand-ins."""
        import ray

        from megatron_agent.rollout import factory
        from megatron_agent.rollout.factory import engine_kwargs
        from megatron_agent.train import cluster, rollout_worker, trainer

        def build_engine(cfg, model_path, cache_dir=None, logits_processors=()):
            return FakeEngine(model_path, self, **engine_kwargs(cfg, cache_dir, logits_processors))

        patches = [
            mock.patch.object(ray, "init", self.init),
            mock.patch.object(ray, "is_initialized", self.is_initialized),
            mock.patch.object(ray, "shutdown", self.shutdown),
            mock.patch.object(ray, "put", lambda obj: obj),
            mock.patch.object(ray, "cluster_resources", self.cluster_resources),
            mock.patch.object(trainer, "WorkerGroup", lambda *a, **k: FakeGroup(self, *a, **k)),
            mock.patch.object(cluster, "redirect_output", lambda path: None),
            mock.patch.object(factory, "build_engine", build_engine),
            mock.patch.object(rollout_worker, "config_from_dict", _config_from_dict_once),
            mock.patch.dict(os.environ),  # RolloutWorker sets TMPDIR
        ]
        previous = sys.modules.get("wandb")
        sys.modules["wandb"] = self.wandb()
        try:
            with contextlib.ExitStack() as stack:
                for p in patches:
                    stack.enter_context(p)
                yield self
        finally:
            if previous is None:
                del sys.modules["wandb"]
            else:
                sys.modules["wandb"] = previous


class _Terminal(io.StringIO):
    """Captured output that says it is a terminal (progress bars draw only on one)."""

    def isatty(self):
        return True


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_TIMES = re.compile(r"^(timing_s|perf)/")


def _summary(x):
    """`x` as plain comparable values: batches, tasks and workers by their contents, timings dropped."""
    kind = type(x)
    if kind in (str, int, bool, type(None)):
        return x
    if kind is float:
        return x if x == x else "nan"  # NaN == NaN
    if kind in (list, tuple):
        if all(type(v) is int for v in x):  # token ids
            return list(x)
        return [_summary(v) for v in x]
    if kind is dict:
        return {str(k): _summary(v) for k, v in x.items() if not _TIMES.match(str(k))}
    if isinstance(x, torch.Tensor):
        return [v if v == v else "nan" for v in x.detach().float().flatten().tolist()]
    if isinstance(x, RLBatch):
        keys = ("uids", "group_ids", "sequences", "rewards", "tensors")
        return {k: _summary(getattr(x, k)) for k in keys}
    if isinstance(x, Task):
        return x.uid
    if isinstance(x, Path):
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _summary(dataclasses.asdict(x))
    if isinstance(x, type):
        return x.__name__
    return type(x).__name__  # a worker object handed on (connect_engines)


def _files(root: Path) -> dict[str, object]:
    """Files under `root`: contents' checksums where they are the run's products, else names only."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if "/tensorboard/" in rel:
            out[re.sub(r"/tensorboard/.*", "/tensorboard/<events>", rel)] = None
        elif "/rollouts/" in rel or "/base_model/" in rel:
            out[rel] = zlib.crc32(path.read_bytes())
        else:  # metrics.jsonl, checkpoints: they hold timings (their metrics are compared without)
            out[rel] = None
    return out


@contextlib.contextmanager
def _tiny_models_once(cache: dict, folder: Path):
    """`make_tiny_model` / `make_quickstart_model` made once per arguments, then copied (same files)."""
    import shutil

    from megatron_agent.models import tiny

    def once(make):
        def copy(out_dir, *args, **kwargs):
            key = (make.__name__, args, tuple(sorted(kwargs.items())))
            if key not in cache:
                cache[key] = make(folder / f"tiny_{len(cache)}", *args, **kwargs)
            shutil.copytree(cache[key], out_dir, dirs_exist_ok=True)
            return Path(out_dir)

        return copy

    with contextlib.ExitStack() as stack:
        for name in ("make_tiny_model", "make_quickstart_model"):
            stack.enter_context(mock.patch.object(tiny, name, once(getattr(tiny, name))))
        yield


def run_effects(cfg, env) -> dict:
    """`Run(cfg).train()` on the stand-in cluster: its status, worker calls, metrics, files and output."""
    from megatron_agent.train.run import Run
    from megatron_agent.train.run_log import read_metrics

    fake, out, err, records = FakeCluster(), _Terminal(), _Terminal(), _Records()
    log = logging.getLogger("megatron_agent")
    log.addHandler(records)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_safe_drills())
            stack.enter_context(_no_sandbox_probes())
            stack.enter_context(_tiny_models_once(*env["tiny"]))
            stack.enter_context(fake.installed())
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            status = Run(cfg).train()
    finally:
        log.removeHandler(records)
    metrics_path = Path(cfg.trainer.run_dir) / "metrics.jsonl"
    table = re.compile(r"^\s*(step\s|-?\d+\s)")  # the console table (its step_s is a timing)
    text, bar = err.getvalue().replace("\r", "\n"), re.compile(r"^[\w ]+:\s+\d+%")  # tqdm's bars
    return {
        "status": status,
        "calls": fake.calls,
        "metrics": _summary(read_metrics(metrics_path)) if metrics_path.exists() else None,
        "files": _files(Path.cwd()),
        "stdout": [line for line in out.getvalue().splitlines() if not table.match(line)],
        "bars": sorted(set(re.findall(r"^(rollout|update):\s+\d+%", text, re.M))),
        "stderr": [line for line in text.splitlines() if line.strip() and not bar.match(line)],
        "warnings": records.messages,
    }


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
        "blocked": str(root / "blocked"),  # a file: no checkpoint folder can be made under it
        "checkpoints": str(root / "checkpoints"),
    }
    passages, _ = synthetic.multihop_corpus(4, seed=5)
    (root / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    files["search_index"] = str(build_search_index(root / "corpus.jsonl", root / "index"))
    _write_checkpoint(files["init_from"], {"sft_steps": 2})
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
    assert any(c[:2] == ["rollout", "generate"] for c in run["calls"]) and run["metrics"][1]["step"] == 1


def test_a_field_that_changes_nothing_fails_by_name(lab, monkeypatch):
    # The check can fail: with agent_loop_config ignoring rollout.top_p, that field is reported.
    from megatron_agent.rollout import factory

    real = factory.agent_loop_config
    monkeypatch.setattr(factory, "agent_loop_config", lambda cfg: dataclasses.replace(real(cfg), top_p=1.0))
    with pytest.raises(AssertionError, match=r"config field rollout\.top_p changes nothing"):
        assert_field_acts("rollout.top_p", lab)
    assert_field_acts("rollout.temperature", lab)  # the others still act
