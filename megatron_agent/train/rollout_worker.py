"""A rollout engine as a Ray actor: vLLM, the agent loop with its tools, and the weight receiver.

The engine lives in its own process (on CPU too), so the trainer's Megatron ranks and vLLM never
share an interpreter. The driver calls `generate`; the Megatron ranks push weights through
`sync_call`, which forwards to `sync.WeightReceiver` (buckets in shared memory on one host, CUDA
IPC or NCCL on GPUs). Trajectories record the weight version that sampled each token.

Threads. The actor runs one call at a time, in the order each caller made them (Ray's ordering
for single-threaded actors, which the weight sync relies on). No call touches the engine itself:
each hands its work to the `EngineThread`, the one thread on which the engine was built and is
stepped, so a sync's calls always run between two engine steps. A rollout is started by
`start_rollout`, which returns at once, and waited for by `collect` (`generate` does both): the
sync's calls are answered while the engine generates. Rollouts started while others run share
the engine's continuous batch, except in deterministic mode, where each waits for the one before.

A sync while rollouts are in flight (`trainer.mode=async`): the sync's first call pauses the
engine between two steps (`AsyncEngine.pause`); the buckets load; `finish` makes the running
requests recompute their KV under the new weights (or keep it: `async.keep_kv`); the probe runs;
the engine resumes, and the interrupted requests continue. In deterministic mode the point is
fixed by the config: a rollout that a sync will interrupt pauses by itself after
`async.interrupt_after_engine_steps` engine steps and waits, and the sync waits for the rollout
the driver names (`sync_point`) to reach that point or to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

from megatron_agent.config import RunPlan, config_from_dict
from megatron_agent.platform.accelerator import cuda_available
from megatron_agent.train.drills import DrillPlan, Drills


class RolloutWorker:
    """One rollout engine with the agent loop."""

    def __init__(self, rank: int, num_engines: int, log_path: str, cfg_dict: dict, plan_dict: dict):
        from megatron_agent.platform import startup_gc
        from megatron_agent.rollout.async_engine import EngineThread
        from megatron_agent.train.cluster import redirect_output

        startup_gc.imports_begin()  # until vLLM is imported (`VLLMEngine`): rare collections
        redirect_output(log_path)
        self.rank = rank
        self.cfg = cfg = config_from_dict(cfg_dict)
        self.plan = plan = RunPlan.from_dict(plan_dict)
        os.environ.setdefault("TMPDIR", cfg.trainer.run_dir)
        self.drills = Drills(DrillPlan.from_config(cfg))  # no-ops unless debug.* is set
        self.thread = EngineThread()
        try:
            self.thread.call(self._build, cfg, plan)
        finally:  # ended by VLLMEngine already; another engine (a test's stand-in) or a failed build: here
            startup_gc.imports_end(freeze=False)
        self.receiver = None
        self.step = 0
        self._idle_s, self._last_end, self._active = 0.0, None, 0
        self._ended_step = 0  # the newest RL step whose rollout ended here
        self._pausing_step: int | None = None  # the RL step whose rollout pauses for a sync
        self._sync_point: tuple[int, bool] | None = None
        self._in_sync = False
        self._rollouts: dict[int, object] = {}  # started, not yet collected (concurrent futures)
        self._num_started = 0
        self._previous = None  # the latest started rollout: the next waits for it when deterministic

    def _build(self, cfg, plan: RunPlan) -> None:
        """The engine, the tools and the agent loop (on the engine thread)."""
        from megatron_agent.rollout.factory import build_agent_loop, build_engine, build_toolset

        processors = self.drills.engine_logits_processors()
        run_dir = cfg.trainer.run_dir
        self.engine = build_engine(cfg, plan.model_path, cache_dir=run_dir, logits_processors=processors)
        hook = self.drills.turn_hook(self.engine.tokenizer)
        tools = build_toolset(cfg, plan.tools, plan.search_index_dir)
        self.loop = build_agent_loop(cfg, self.engine, tools, turn_hook=hook)
        self.pump = self.loop.engine  # the AsyncEngine that steps the engine
        if plan.share_cores and not cuda_available():  # the ranks of this machine follow its steps
            import ray

            from megatron_agent.platform.core_sharing import EngineActivity

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
            try:
                self.pump.activity = EngineActivity(node)
            except (AttributeError, OSError) as exc:  # no memfd_create (not Linux): nothing shared
                print(f"async.share_cores: the engine cannot publish its activity ({exc}); not shared")

    def ping(self) -> int:
        """Liveness check; returns the engine index."""
        return self.rank

    def activity_handle(self):
        """Where the ranks of this machine read whether this engine generates (an `ActivityHandle`,
        `async.share_cores`; None when it does not say)."""
        return self.pump.activity.handle() if self.pump.activity is not None else None

    # ----------------------------------------------------------------------------- rollouts
    def generate(self, tasks: list, n: int, greedy: bool = False) -> list:
        """`n` trajectories per task (task-major order); greedy for validation."""
        return self.collect(self.start_rollout(tasks, n, greedy))

    def start_rollout(
        self,
        tasks: list,
        n: int,
        greedy: bool = False,
        reseed: tuple | None = None,
        pause_after: int | None = None,
    ) -> int:
        """Start `generate` on the engine thread and return its id at once (`collect` waits).
        `reseed`: the `reseed` arguments this rollout applies when it starts (an async run's
        batches bring their own); `pause_after`: engine steps after which it pauses for a weight
        sync (deterministic async runs)."""
        step = self.step if reseed is None else int(reseed[1])
        previous = self._previous if self.cfg.trainer.deterministic else None
        coroutine = _generate(self, tasks, n, greedy, step, reseed, pause_after, previous)
        future = asyncio.run_coroutine_threadsafe(coroutine, self.thread.loop)
        self._num_started += 1
        self._rollouts[self._num_started] = self._previous = future
        return self._num_started

    def collect(self, rollout_id: int) -> list:
        """The trajectories of a started rollout (waits for them)."""
        return self._rollouts.pop(rollout_id).result()

    def idle_seconds(self) -> float:
        """Seconds this engine ran no rollout since the last call (an async run's
        `timing_s/wait_update`)."""
        idle, self._idle_s = self._idle_s, 0.0
        return idle

    def reseed(self, seed: int, step: int = 0) -> None:
        """Seed this process's python/numpy/torch RNGs (vLLM samples from torch's) with seed + rank,
        before RL step `step`."""
        self.step = step
        self._seed_rngs(seed)
        if self.loop.config.seed is not None:  # deterministic mode: per-request seeds of this step
            self.loop.config = dataclasses.replace(self.loop.config, seed=seed)

    def _seed_rngs(self, seed: int) -> None:
        import random

        import numpy as np
        import torch

        random.seed(seed + self.rank)
        np.random.seed((seed + self.rank) % 2**32)
        torch.manual_seed(seed + self.rank)

    def tool_metrics(self) -> dict[str, float]:
        """`tool/unsandboxed` (since the last call) and `tool/sandboxed` of this engine's tools."""
        from megatron_agent.envs.tools import sandbox_metrics

        return sandbox_metrics(self.loop.tools)

    def weight_version(self) -> int:
        """The engine's weight version (bumped by every sync)."""
        return self.engine.weight_version

    # ----------------------------------------------------------------------------- weights
    def sync_point(self, step: int, may_pause: bool) -> None:
        """Where the next sync applies (deterministic async runs): once the rollout of RL step
        `step` has ended here or, with `may_pause`, paused for it (`start_rollout`'s `pause_after`)."""
        self._sync_point = (int(step), bool(may_pause))

    def sync_call(self, method: str, *args, **kwargs):
        """Entry point of the weight sync (see `megatron_agent.sync`), run between engine steps."""
        return self.thread.run(_sync_call(self, method, *args, **kwargs))

    def close(self) -> None:
        """Stop the agent loop's engine pump and the engine thread."""
        self.thread.call(self.loop.engine.close)
        self.thread.close()


# The worker's coroutines (they run on its engine thread's event loop) are functions of the module,
# not methods: a Ray actor class with an `async def` method becomes an asyncio actor, whose calls
# Ray may run out of the order their caller made them; a sync's `finish` could then overtake its
# last `load_bucket` ("buckets never reached the engine"). tests/train/test_rollout_worker_order.py.


async def _generate(worker: RolloutWorker, tasks, n, greedy, step, reseed, pause_after, previous) -> list:
    if previous is not None:  # deterministic: one rollout after the other, in the order started
        await asyncio.wait([asyncio.wrap_future(previous)])
    config = worker.loop.config
    if reseed is not None:
        worker._seed_rngs(reseed[0])
        if config.seed is not None:  # deterministic mode: per-request seeds of this rollout
            config = dataclasses.replace(config, seed=reseed[0])
    if greedy:
        config = dataclasses.replace(config, temperature=0.0, top_p=1.0, top_k=-1)
    if worker.cfg.trainer.deterministic and hasattr(worker.engine, "reset_prefix_cache"):
        worker.engine.reset_prefix_cache()  # the same (empty) cache whatever ran before
    if not greedy:
        worker.drills.reached("rollout", step)
    if worker._active == 0 and worker._last_end is not None:
        worker._idle_s += time.perf_counter() - worker._last_end
    worker._active += 1
    try:
        if pause_after is not None:
            worker._pausing_step = step
            worker.pump.pause_after(worker.pump.num_steps + pause_after)
        with worker.drills.around_rollout(worker.engine, worker.rank, greedy):
            return await worker.loop.run_async(tasks, n, config=config)
    finally:
        if pause_after is not None:
            worker.pump.pause_after(None)
            worker._pausing_step = None
        if not greedy:
            worker._ended_step = max(worker._ended_step, step)
        worker._active -= 1
        worker._last_end = time.perf_counter()


async def _sync_call(worker: RolloutWorker, method: str, *args, **kwargs):
    if worker.receiver is None:
        from megatron_agent.sync import WeightReceiver

        worker.receiver = WeightReceiver(worker.engine, in_flight=worker.plan.mode == "async")
    if method in ("load_bucket", "finish") and not worker._in_sync:  # a sync starts
        await _reach_sync_point(worker)
        worker.pump.pause()
        worker._in_sync = True
    result = worker.receiver.handle(method, *args, **kwargs)
    last = "probe" if worker.cfg.sync.verify else "finish"
    if worker._in_sync and method == last:  # the sync is over: generation goes on
        worker._in_sync = False
        worker.pump.resume()
    return result


async def _reach_sync_point(worker: RolloutWorker) -> None:
    """Wait until the engine is at the point `sync_point` named (at once when none was)."""
    point, worker._sync_point = worker._sync_point, None
    if point is None:
        return
    step, may_pause = point
    while not (
        worker._ended_step >= step or (may_pause and worker._pausing_step == step and worker.pump.paused)
    ):
        await asyncio.sleep(0.002)  # a state that, once reached, holds until this sync
