"""AsyncEngine: N EngineCores in the current event loop behind one in-process client.

This is what `serve` talks to (vLLM's AsyncLLM in miniature): requests go to the least loaded
engine unless they pin a data-parallel rank, and each request's outputs are collected so a slow
reader gets them merged instead of queueing one object per token (vLLM's RequestOutputCollector).

Two ways to read a request: `generate()` yields its outputs to a task (wake-up per output);
`push()` hands them to a synchronous callback while the reading task stays parked, once per turn
of the event loop, so a stream costs no task wake-up per token and the engine's back-to-back
steps merge into one delivery (the streaming HTTP path uses it). With push's `take`, a steady
decode's token skips even that: the engine hands it to the reader during the step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from .clock import RealClock, VirtualClock
from .config import EngineArgs
from .core import EngineCore, EngineDeadError
from .lockstep import DataParallelLockstep
from .request import TAKEN_WAKE, TokenSink
from .types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger("vllm_vcr.engine")
OutputListener = Callable[[int, EngineCoreOutputs], None]
# (engine index, request id) -> a callable told the step's clock time of each of the request's
# tokens that its reader took directly (None: this listener cannot follow the request that way)
TokenObserverFactory = Callable[[int, str], Callable[[float], None] | None]
# a push reader's direct take of a steady token: DECLINED, TAKEN or TAKEN_WAKE (request.py)
TakeToken = Callable[[int], int]


class _SteadyMember:
    """A pushed stream as a member of its engine's steady batches (steady_batch.py's BatchReader):
    its reader's part (the HTTP stream's columns) and its token observers' (the metrics')."""

    __slots__ = ("kind", "reader", "col", "observers")

    def __init__(self, idx: int, reader: Any, col: _Collector, observers: list) -> None:
        self.kind = (idx, reader.kind)
        self.reader = reader
        self.col = col
        self.observers = observers

    def ready(self) -> bool:
        col = self.col
        return col.pending is None and col.error is None and self.reader.ready()

    def new_columns(self) -> _SteadyColumns:
        return _SteadyColumns(self.reader.new_columns(), [o.new_group() for o in self.observers])


class _SteadyColumns:
    """One steady batch's members, as its readers and its token observers see them."""

    __slots__ = ("readers", "groups", "collectors")

    def __init__(self, readers: Any, groups: list) -> None:
        self.readers = readers
        self.groups = groups
        self.collectors: list[_Collector] = []

    def add(self, member: _SteadyMember) -> None:
        self.readers.add(member.reader)
        for group, observer in zip(self.groups, member.observers):
            group.add(observer)
        self.collectors.append(member.col)

    def drop(self, index: int) -> None:
        self.readers.drop(index)
        for group in self.groups:
            group.drop(index)
        del self.collectors[index]

    def take(self, tokens: list[int], ts: float) -> list[int] | None:
        try:
            declined = self.readers.take(tokens, ts)
            for group in self.groups:
                group.observe(ts, declined)
        except Exception as e:  # as the one-token sink: it fails the requests (all of the batch's), never the engine
            logger.exception("a steady batch's readers failed")
            for col in self.collectors:
                col.fail(e)
            return None
        return declined


class DataParallelRankError(ValueError):
    pass


def deliver_outputs(engine_index: int, outs: EngineCoreOutputs, listeners: list,
                    collectors: dict[str, tuple[int, Any]]) -> None:
    """One engine's output batch to the output listeners (metrics, ...), then each output to the
    collector of its request's reader (an in-process engine and the engine-core client alike). A
    listener that fails is logged; the readers still get their outputs."""
    for listener in listeners:
        try:
            listener(engine_index, outs)
        except Exception:
            logger.exception("output listener failed")
    for o in outs.outputs:
        entry = collectors.get(o.request_id)
        if entry is not None:
            entry[1].put(o)


def pick_engine_index(rank: int | None, load: list[int], rr: int) -> tuple[int, int]:
    """vLLM's data-parallel balancing in the API server: the rank a request pins, else the engine
    with the fewest unfinished requests, round robin from `rr` among equals. Returns (index, next rr)."""
    n = len(load)
    if rank is not None:
        if not 0 <= rank < n:
            raise DataParallelRankError(
                f"data_parallel_rank {rank} is out of range [0, {n}) for data parallel size {n}")
        return rank, rr
    if n == 1:
        return 0, rr
    best = min(range(n), key=lambda i: (load[i], (i - rr) % n))
    return best, (best + 1) % n


class EngineStartupError(RuntimeError):
    """Simulated model loading failed; every waiting request gets this message."""


class _Collector:
    __slots__ = ("deliver", "error", "finished", "pending", "push_queue", "queued", "waiter", "wake")

    def __init__(self, deliver: Callable[[EngineCoreOutput], bool] | None = None,
                 push_queue: _PushQueue | None = None) -> None:
        self.pending: EngineCoreOutput | None = None
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.finished = False  # the engine ended the request (leaving early must not abort it)
        self.deliver = deliver  # push mode: outputs go here while the reader is parked
        self.queued = False
        self.push_queue = push_queue
        self.wake = False

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
        if out.finish_reason is not None:
            self.finished = True
        w = self.waiter
        if w is not None and not w.done():
            if self.deliver is None:
                w.set_result(None)
            elif not self.queued:  # onto the push queue (inline: this runs once per output)
                self.queued = True
                q = self.push_queue
                if not q.collectors:
                    # flushed after the engine task yields: its back-to-back steps arrive as one delivery
                    asyncio.get_running_loop().call_soon(q.flush)
                q.collectors.append(self)

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

    def _hand_over(self) -> None:
        """Push mode: deliver what is pending; the reader must wake when the callback says so
        (or the request finished, or the callback failed: that fails the request, never the loop)."""
        out, self.pending = self.pending, None
        try:
            if self.deliver(out) or self.finished:
                self.wake = True
        except Exception as e:
            self.error = e

    async def wait(self) -> None:
        """Push mode: park until the callback asks for the reader (or the request fails)."""
        while True:
            if self.wake:  # before the error: what was delivered came first
                self.wake = False
                return
            if self.pending is not None:
                self._hand_over()
                continue
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None


class _PushQueue:
    """Push-mode collectors with outputs, delivered together once the engine yields the loop."""

    __slots__ = ("collectors",)

    def __init__(self) -> None:
        self.collectors: list[_Collector] = []

    def flush(self) -> None:
        cols, self.collectors = self.collectors, []
        for col in cols:
            col.queued = False
            w = col.waiter
            out = col.pending
            # a reader that is awake (or about to be) takes the pending output itself
            if w is None or out is None or w.done():
                continue
            col.pending = None  # _Collector._hand_over, inline: this runs once per output
            try:
                if col.deliver(out) or col.finished:
                    col.wake = True
                    w.set_result(None)
            except Exception as e:
                col.error = e
                w.set_result(None)


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
        DataParallelLockstep.attach(self.engines)  # an MoE model's DP ranks step together, as in vLLM
        self._collectors: dict[str, tuple[int, _Collector]] = {}
        self._push_queue = _PushQueue()
        self._load = [0] * engine_count
        self._rr = 0
        self._listeners: list[OutputListener] = []
        self._token_observers: list[TokenObserverFactory] = []
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
    def num_unfinished_requests(self) -> int:
        """Requests handed to an engine and not yet ended, all engines (vLLM's admission count)."""
        return sum(self._load)

    @property
    def tasks(self) -> list[asyncio.Task]:
        """The engines' loop tasks, one per engine once started (in engine order)."""
        return list(self._tasks)

    @property
    def is_running(self) -> bool:
        return bool(self._tasks) and all(not t.done() for t in self._tasks)

    def add_output_listener(self, listener: OutputListener, token_observer: TokenObserverFactory | None = None) -> None:
        """`listener` sees every engine batch. A token that a push reader takes directly (`push`'s
        `take`) is in no batch: a listener that counts tokens passes a `token_observer` for them."""
        self._listeners.append(listener)
        if token_observer is not None:
            self._token_observers.append(token_observer)

    # --- outputs -------------------------------------------------------------------------------
    def _make_sink(self, engine_index: int) -> Callable[[int, EngineCoreOutputs], None]:
        def sink(client_index: int, outs: EngineCoreOutputs) -> None:
            deliver_outputs(engine_index, outs, self._listeners, self._collectors)
        return sink

    # --- requests ------------------------------------------------------------------------------
    def pick_engine(self, request: EngineCoreRequest) -> int:
        idx, self._rr = pick_engine_index(request.data_parallel_rank, self._load, self._rr)
        return idx

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Submit a request and yield its outputs; leaving early aborts it in the engine."""
        col = _Collector()
        async with self._attached(request, col):
            while True:
                out = await col.get()
                yield out
                if out.finish_reason is not None:
                    return

    async def push(self, request: EngineCoreRequest, deliver: Callable[[EngineCoreOutput], bool],
                   take: TakeToken | None = None, batch_reader: Any = None) -> AsyncIterator[None]:
        """Submit a request whose outputs go to `deliver` (synchronously, merged per turn of the
        event loop) while the caller is parked; yields whenever `deliver` returns True or the
        request has finished, and ends after its final output. Leaving before the engine finished
        it aborts it.

        With `take`, the engine offers each steady decode's token to it during the step (see
        OutputProcessor._steady_decode) whenever no output waits for `deliver` (order is kept); it
        answers DECLINED, TAKEN or TAKEN_WAKE (request.py). A `batch_reader` (steady_batch.py's
        BatchReader) lets the request's steady decodes join the engine's steady batches."""
        col = _Collector(deliver, self._push_queue)
        # _attached's steps inline (no context manager objects: this runs once per stream)
        idx = self.pick_engine(request)
        if not self.is_ready:
            await self.wait_ready()
        sink, member = (self._token_sink(idx, request.request_id, col, take, batch_reader) if take is not None
                        else (None, None))
        core = self._submit(idx, request, col, sink, member)
        try:
            while True:
                await col.wait()
                yield None
                if col.finished and col.pending is None:
                    return  # everything, up to the final output, has been delivered
        finally:
            self._detach(idx, core, request.request_id, col)

    @asynccontextmanager
    async def _attached(self, request: EngineCoreRequest, col: _Collector) -> AsyncIterator[None]:
        idx = self.pick_engine(request)
        if not self.is_ready:
            await self.wait_ready()
        core = self._submit(idx, request, col)
        try:
            yield
        finally:
            self._detach(idx, core, request.request_id, col)

    def _token_sink(self, idx: int, rid: str, col: _Collector, take: TakeToken,
                    batch_reader: Any) -> tuple[TokenSink | None, _SteadyMember | None]:
        """The engine's side of `push`'s `take`: a token goes to the reader directly (and to the
        listeners' token observers) unless an output is still waiting for the reader."""
        observers = [factory(idx, rid) for factory in self._token_observers]
        if None in observers:
            return None, None  # a listener cannot count this request's tokens outside the batches
        if len(observers) == 1:  # (the usual case: the metrics)
            observe = observers[0]
        else:
            def observe(ts: float) -> None:
                for o in observers:
                    o(ts)

        def sink(token: int, ts: float) -> bool:
            if col.pending is not None or col.error is not None:
                return False
            try:
                taken = take(token)
            except Exception as e:  # as _Collector._hand_over: it fails the request, never the engine
                col.fail(e)
                return True
            if not taken:
                return False
            observe(ts)
            if taken == TAKEN_WAKE:  # the socket pushed back: the reader sends what it queued
                col.wake = True
                w = col.waiter
                if w is not None and not w.done():
                    w.set_result(None)
            return True

        groups = [getattr(o, "new_group", None) for o in observers]
        member = None if batch_reader is None or None in groups else _SteadyMember(idx, batch_reader, col, observers)
        return sink, member

    def _submit(self, idx: int, request: EngineCoreRequest, col: _Collector,
                token_sink: TokenSink | None = None, batch_member: Any = None) -> EngineCore:
        """Register the request's collector and hand the request to engine idx."""
        core = self.engines[idx]
        if core.dead is not None or core.stopped:
            raise EngineDeadError(f"engine {idx} is not running")
        rid = request.request_id
        self._collectors[rid] = (idx, col)
        self._load[idx] += 1
        try:
            core.add_request(request, token_sink, batch_member)
        except BaseException:
            self._detach(idx, core, rid, col)
            raise
        return core

    def _detach(self, idx: int, core: EngineCore, rid: str, col: _Collector) -> None:
        """The reader has left: forget its collector; abort the request unless the engine ended it."""
        self._load[idx] -= 1
        if self._collectors.get(rid, (None, None))[1] is col:
            del self._collectors[rid]
        if not col.finished and core.dead is None:
            core.abort_requests([rid])

    async def call_all(self, fn: Callable[[EngineCore], Any]) -> list[Any]:
        """Run fn on every engine between two of its steps, in engine order."""
        return [await core.call(fn) for core in self.engines]

    async def reset_prefix_cache(self) -> list[bool]:
        """Every engine's prefix cache reset (an engine with requests in flight refuses: False)."""
        return [r is not False for r in await self.call_all(lambda core: core.reset_prefix_cache())]

    async def loads(self) -> list[dict[str, Any]]:
        """Every engine's scheduler load (EngineControls.load), in engine order."""
        return await self.call_all(lambda core: core.load())


# The output collectors, shared with the engine-core client of a multi-process serve
# (wire/client.py): one way of handing outputs to readers whatever carries them.
Collector = _Collector
PushQueue = _PushQueue
