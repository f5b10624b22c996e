"""AsyncEngine: N EngineCores in the current event loop behind one in-process client.

This is what `serve` talks to (vLLM's AsyncLLM in miniature): requests go to the least loaded
engine unless they pin a data-parallel rank, and each request's outputs are collected so a slow
reader gets them merged instead of queueing one object per token (vLLM's RequestOutputCollector).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from .clock import RealClock, VirtualClock
from .config import EngineArgs
from .core import EngineCore, EngineDeadError
from .types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger("vllm_vcr.engine")
OutputListener = Callable[[int, EngineCoreOutputs], None]


class DataParallelRankError(ValueError):
    pass


class EngineStartupError(RuntimeError):
    """Simulated model loading failed; every waiting request gets this message."""


class _Collector:
    __slots__ = ("pending", "waiter", "error")

    def __init__(self) -> None:
        self.pending: EngineCoreOutput | None = None
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None

    def put(self, out: EngineCoreOutput) -> None:
        p = self.pending
        if p is None:
            self.pending = out
        else:  # the reader lags: merge into one delta, as vLLM's collector does
            p.new_token_ids = p.new_token_ids + out.new_token_ids
            if out.events:
                p.events = (p.events or []) + out.events
            if p.prefill_stats is None:
                p.prefill_stats = out.prefill_stats
            p.finish_reason = out.finish_reason
            p.stop_reason = out.stop_reason
            p.kv_transfer_params = out.kv_transfer_params or p.kv_transfer_params
            p.error = out.error or p.error
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, error: BaseException) -> None:
        self.error = error
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> EngineCoreOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        out, self.pending = self.pending, None
        return out


class AsyncEngine:
    def __init__(self, args: EngineArgs, engine_count: int = 1, *, clock: RealClock | VirtualClock | None = None,
                 **core_kwargs: Any) -> None:
        if engine_count < 1:
            raise ValueError(f"--engine-count must be >= 1, got {engine_count}")
        self.args = args
        clock = clock or RealClock()
        self.engines = [
            EngineCore(args, engine_index=i, clock=clock, output_sink=self._make_sink(i), **core_kwargs)
            for i in range(engine_count)
        ]
        self._collectors: dict[str, tuple[int, _Collector]] = {}
        self._load = [0] * engine_count
        self._rr = 0
        self._listeners: list[OutputListener] = []
        self._tasks: list[asyncio.Task] = []
        self.startup_error: str | None = None
        self._ready: asyncio.Event | None = None
        self._startup_task: asyncio.Task | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engines, after --startup-time of simulated loading (requests wait for it)."""
        self._ready = asyncio.Event()
        if self.args.startup_time > 0 or self.args.startup_failure:
            self._startup_task = asyncio.get_running_loop().create_task(self._simulate_loading())
        else:
            self._start_engines()

    async def _simulate_loading(self) -> None:
        await asyncio.sleep(self.args.startup_time / self.args.time_scale)
        if self.args.startup_failure:
            self.startup_error = self.args.startup_failure
            logger.error("engine start-up failed: %s", self.startup_error)
            self._ready.set()
            return
        self._start_engines()

    @property
    def is_ready(self) -> bool:
        return self._ready is not None and self._ready.is_set() and self.startup_error is None

    async def wait_ready(self) -> None:
        if self._ready is None:
            raise EngineDeadError("engine not started")
        await self._ready.wait()
        if self.startup_error is not None:
            raise EngineStartupError(self.startup_error)

    def _start_engines(self) -> None:
        for core in self.engines:
            task = asyncio.get_running_loop().create_task(core.run(), name=f"engine-{core.engine_index}")
            task.add_done_callback(self._on_engine_exit)
            self._tasks.append(task)
        self._ready.set()

    async def stop(self, timeout: float | None = None) -> None:
        """Shut every engine down (timeout 0 aborts at once; > 0 drains) and wait for the loops."""
        if self._startup_task is not None and not self._startup_task.done():
            self._startup_task.cancel()
        for core in self.engines:
            core.shutdown(timeout)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_engine_exit(self, task: asyncio.Task) -> None:
        idx = self._tasks.index(task) if task in self._tasks else -1
        err = EngineDeadError(f"engine {idx} stopped")
        for rid, (i, col) in list(self._collectors.items()):
            if i == idx:
                col.fail(err)

    @property
    def is_running(self) -> bool:
        return bool(self._tasks) and all(not t.done() for t in self._tasks)

    def add_output_listener(self, listener: OutputListener) -> None:
        self._listeners.append(listener)

    # --- outputs -------------------------------------------------------------------------------
    def _make_sink(self, engine_index: int) -> Callable[[int, EngineCoreOutputs], None]:
        def sink(client_index: int, outs: EngineCoreOutputs) -> None:
            for listener in self._listeners:
                listener(engine_index, outs)
            collectors = self._collectors
            for o in outs.outputs:
                entry = collectors.get(o.request_id)
                if entry is not None:
                    entry[1].put(o)
        return sink

    # --- requests ------------------------------------------------------------------------------
    def pick_engine(self, request: EngineCoreRequest) -> int:
        n = len(self.engines)
        rank = request.data_parallel_rank
        if rank is not None:
            if not 0 <= rank < n:
                raise DataParallelRankError(
                    f"data_parallel_rank {rank} is out of range [0, {n}) for data parallel size {n}")
            return rank
        if n == 1:
            return 0
        best = min(range(n), key=lambda i: (self._load[i], (i - self._rr) % n))
        self._rr = (best + 1) % n
        return best

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Submit a request and yield its outputs; leaving early aborts it in the engine."""
        idx = self.pick_engine(request)
        if not self.is_ready:
            await self.wait_ready()
        core = self.engines[idx]
        if core.dead is not None or core._stopped:
            raise EngineDeadError(f"engine {idx} is not running")
        rid = request.request_id
        col = _Collector()
        self._collectors[rid] = (idx, col)
        self._load[idx] += 1
        finished = False
        try:
            core.add_request(request)
            while True:
                out = await col.get()
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._load[idx] -= 1
            if self._collectors.get(rid, (None, None))[1] is col:
                del self._collectors[rid]
            if not finished and core.dead is None:
                core.abort_requests([rid])

    async def call_all(self, fn: Callable[[EngineCore], Any]) -> list[Any]:
        """Run fn on every engine between two of its steps, in engine order."""
        return [await core.call(fn) for core in self.engines]
