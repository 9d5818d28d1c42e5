"""A rollout engine as a Ray actor: vLLM, the agent loop with its tools, and the weight receiver.

The engine lives in its own process (on CPU too), so the trainer's Megatron ranks and vLLM never
share an interpreter. The driver calls `generate`; the Megatron ranks push weights through
`sync_call`, which forwards to `sync.WeightReceiver` (buckets in shared memory on one host, CUDA
IPC or NCCL on GPUs). Trajectories record the engine's `weight_version`.
"""

from __future__ import annotations

import dataclasses
import os
import time

from megatron_agent.config import RunPlan, config_from_dict
from megatron_agent.train.drills import DrillPlan, Drills


class RolloutWorker:
    """One rollout engine with the agent loop."""

    def __init__(self, rank: int, num_engines: int, log_path: str, cfg_dict: dict, plan_dict: dict):
        from megatron_agent.rollout.factory import build_agent_loop, build_engine, build_toolset
        from megatron_agent.train.cluster import redirect_output

        redirect_output(log_path)
        self.rank = rank
        self.cfg = cfg = config_from_dict(cfg_dict)
        plan = RunPlan.from_dict(plan_dict)
        run_dir = cfg.trainer.run_dir
        os.environ.setdefault("TMPDIR", run_dir)
        self.drills = Drills(DrillPlan.from_config(cfg))  # no-ops unless debug.* is set
        processors = self.drills.engine_logits_processors()
        self.engine = build_engine(cfg, plan.model_path, cache_dir=run_dir, logits_processors=processors)
        hook = self.drills.turn_hook(self.engine.tokenizer)
        tools = build_toolset(cfg, plan.tools, plan.search_index_dir)
        self.loop = build_agent_loop(cfg, self.engine, tools, turn_hook=hook)
        self.receiver = None
        self.step = 0
        self._idle_s, self._last_end = 0.0, None

    def ping(self) -> int:
        """Liveness check; returns the engine index."""
        return self.rank

    def generate(self, tasks: list, n: int, greedy: bool = False) -> list:
        """`n` trajectories per task (task-major order); greedy for validation."""
        base = self.loop.config
        if greedy:
            self.loop.config = dataclasses.replace(base, temperature=0.0, top_p=1.0, top_k=-1)
        if self.cfg.trainer.deterministic and hasattr(self.engine, "reset_prefix_cache"):
            self.engine.reset_prefix_cache()  # the same (empty) cache whatever ran before
        if not greedy:
            self.drills.reached("rollout", self.step)
        if self._last_end is not None:
            self._idle_s += time.perf_counter() - self._last_end
        try:
            with self.drills.around_rollout(self.engine, self.rank, greedy):
                return self.loop.run(tasks, n)
        finally:
            self.loop.config = base
            self._last_end = time.perf_counter()

    def idle_seconds(self) -> float:
        """Seconds this engine waited between rollouts since the last call (an async run's
        `timing_s/wait_update`)."""
        idle, self._idle_s = self._idle_s, 0.0
        return idle

    def reseed(self, seed: int, step: int = 0) -> None:
        """Seed this process's python/numpy/torch RNGs (vLLM samples from torch's) with seed + rank,
        before RL step `step`."""
        self.step = step
        import random

        import numpy as np
        import torch

        random.seed(seed + self.rank)
        np.random.seed((seed + self.rank) % 2**32)
        torch.manual_seed(seed + self.rank)
        if self.loop.config.seed is not None:  # deterministic mode: per-request seeds of this step
            self.loop.config = dataclasses.replace(self.loop.config, seed=seed)

    def set_weight_version(self, version: int) -> None:
        """Continue the version count of a resumed run (the next sync makes it `version + 1`)."""
        self.engine.weight_version = int(version)

    def tool_metrics(self) -> dict[str, float]:
        """`tool/unsandboxed` (since the last call) and `tool/sandboxed` of this engine's tools."""
        from megatron_agent.envs.tools import sandbox_metrics

        return sandbox_metrics(self.loop.tools)

    def weight_version(self) -> int:
        """The engine's weight version (bumped by every sync)."""
        return self.engine.weight_version

    def sync_call(self, method: str, *args, **kwargs):
        """Entry point of the weight sync (see `megatron_agent.sync`)."""
        if self.receiver is None:
            from megatron_agent.sync import WeightReceiver

            self.receiver = WeightReceiver(self.engine)
        return self.receiver.handle(method, *args, **kwargs)

    def close(self) -> None:
        """Stop the agent loop's engine pump."""
        self.loop.engine.close()
