"""The config-effects test's probes: what the run builds from a config, on fixed inputs, in this process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import types
from pathlib import Path
from unittest import mock

import torch

from megatron_agent.config.schema import KILL_PHASES
from megatron_agent.rollout.trajectory import TokenSource, Trajectory


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


def probe_critic(cfg, plan, env):
    """The critic's optimizer and schedule, its epochs (the real `CriticUpdate.run` loop over
    recorded optimizer steps) and its clipped value loss on a fixed batch."""
    from megatron_agent.rl.value_loss import clipped_value_loss
    from megatron_agent.train.critic_role import critic_optimizer_config
    from megatron_agent.train.critic_update import CriticUpdate
    from megatron_agent.train.megatron_worker import scheduler_options

    update = CriticUpdate(None, cfg.critic, None, None, micro_batch_tokens=cfg.actor.micro_batch_tokens)
    update._optimizer_step = lambda batch, indices: {"n_optimizer_steps": 1.0}
    batch = fixed_batch()
    mask = batch.padded("loss_mask").bool()
    g = torch.Generator().manual_seed(3)
    old = torch.randn(mask.shape, generator=g)
    values, returns = old + 0.8 * torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    loss, sums = clipped_value_loss(
        values, old, returns, mask, cliprange_value=cfg.critic.cliprange_value, normalizer=float(mask.sum())
    )
    return {
        "optim": dataclasses.asdict(critic_optimizer_config(cfg)),
        "scheduler": scheduler_options(cfg, plan.total_optimizer_steps, "critic"),
        "steps": update.run(batch, [[0], [1]]),
        "loss": {"loss": loss, **sums},
    }


def probe_engine(cfg, plan, env):
    from megatron_agent.rollout.factory import engine_kwargs

    return engine_kwargs(cfg, cache_dir=cfg.trainer.run_dir)  # what RolloutWorker passes


def probe_agent_loop(cfg, plan, env):
    from megatron_agent.rollout.factory import agent_loop_config

    return dataclasses.asdict(agent_loop_config(cfg))


@contextlib.contextmanager
def _no_sandbox_probes():
    """The python tool's probes of this machine (bubblewrap, `unshare`, cgroups) answered without
    starting a process or making a cgroup (the unit tier does neither): bubblewrap works, and call
    cgroups would go to a folder that no call of this test ever makes."""
    from megatron_agent.envs.tools import cgroups, python

    where = cgroups.Support(1, {c: Path("/nonexistent/cgroup") for c in cgroups.CONTROLLERS})
    with (
        mock.patch.object(python, "_probe", lambda bwrap: None),
        mock.patch.object(python.bw, "find_bwrap", lambda path=None: "/usr/bin/bwrap"),
        mock.patch.object(python.cgroups, "support", lambda: where),
        mock.patch.object(python, "unsandboxed_prefix", lambda: ()),
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
            keys = ("mode", "memory_mb", "max_processes", "tmp_mb", "max_concurrent", "timeout_s", "path")
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

    quantization = None  # what an engine started with rollout.quantization says (qdq formats run here)
    if cfg.rollout.quantization.endswith("_qdq"):
        from megatron_agent.rollout.quantized import prepare_quantized_engine

        quantization = prepare_quantized_engine(
            "", cfg.rollout.quantization, cfg.rollout.fp8_scales, "", None
        )[1]
    engine = types.SimpleNamespace(weight_version=0, on_gpu=False, quantization=quantization)
    endpoint = _StubEndpoint(WeightReceiver(engine))
    model = types.SimpleNamespace(
        chunks=[torch.nn.Linear(4, 4)], opts=build_options(cfg), arch=types.SimpleNamespace(vocab_size=64)
    )
    if plan.qat_format:  # as MegatronWorker._new_actor marks a QAT actor ...
        from megatron_agent.quant.formats import format_named

        model.qat_format = format_named(plan.qat_format)
    elif quantization:  # ... or one whose probe forward computes with the engines' quantized weights
        from megatron_agent.quant.formats import rollout_format

        model.probe_format = rollout_format(cfg.rollout.quantization, cfg.rollout.fp8_scales)[0]
    role = SyncRole(0, 0, 1, True, True, True, True)
    with mock.patch.object(SyncRole, "current", classmethod(lambda cls: role)):
        sender = WeightSender(model, cfg.sync, [endpoint], rollout_dtype=rollout_dtype(cfg))
    sender._connect()  # what the first sync does: ask the engines, pick transports and checksums
    keys = ("bucket_bytes", "stage_bytes", "tol", "transports", "device", "algo", "quantizer")
    return {**{k: getattr(sender, k) for k in keys}, "timeouts": endpoint.timeouts}
