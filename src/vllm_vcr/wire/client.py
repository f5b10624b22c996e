"""The frontend side of vLLM's engine-core protocol: what one API server process of
`serve --api-server-count N` talks to its engine-core process(es) with.

vLLM's shape (core_client.py's AsyncMPClient): the API server binds one input socket (ROUTER)
and one output socket (PULL); every engine-core process connects a DEALER to the first and a
PUSH to the second, and announces itself by sending its ready payload on the input socket (its
ZMQ identity is its data-parallel rank, two bytes little-endian). Requests go out as
`[identity, ADD, EngineCoreRequest]` / `[identity, ABORT, [ids]]`; outputs come back as one
`EngineCoreOutputs` per engine step, or ENGINE_CORE_DEAD when the engine is gone.

`EngineCoreClient` has the interface the frontend already uses for the in-process engine
(engine/async_engine.py's AsyncEngine: `generate`, `push`, output listeners, the unfinished
count, `is_running`, `reset_prefix_cache` as a utility call), and reuses its output collectors, so
one code path renders responses whatever the process layout. Sleep, pause and the weight version
are utility calls too (`utility`, used by vllm/sleep.py and vllm/rl.py); `/abort_requests` ends
this API server's own requests (`abort_tracked`), as vLLM's output processor does. What needs an
engine object in this process (`engines`, `call_all`) is refused with an HTTP 500 that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..engine.async_engine import Collector, OutputListener, PushQueue, TakeToken, deliver_outputs, pick_engine_index
from ..engine.core import EngineDeadError
from ..engine.types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from ..frontend.errors import ENGINE_DEAD_MESSAGE
from ..frontend.errors import HTTPError
from .codec import ABORT, ADD, ENGINE_CORE_DEAD, EXT_RAW_VIEW, UTILITY
from .handshake import identity_for
from .reader import FrameReader

log = logging.getLogger("vllm_vcr.wire.client")


# s beyond --shutdown-timeout that a stopping API server waits for its requests (past uvicorn's
# graceful-shutdown wait, which is --shutdown-timeout + 5 s: its connections are closed by then)
STOP_GRACE = 6.0
NOT_IN_THIS_PROCESS = ("not available with --api-server-count > 1: the engines run in their own process(es) "
                       "(docs/api-servers.md)")


class UtilityError(RuntimeError):
    """An engine answered a utility call with a failure message."""


def _ext_hook(code: int, data: memoryview) -> Any:
    # logprobs arrays an engine-core attaches for vLLM's frontend: this frontend computes its own
    return bytes(data) if code == EXT_RAW_VIEW else None


class EngineCoreClient:
    """One API server's connection to `engine_count` engine-core processes (DP ranks)."""

    def __init__(self, args: Any, *, input_address: str, output_address: str, engine_count: int = 1,
                 client_index: int = 0, ready_timeout: float = 300.0) -> None:
        self.args = args
        self.input_address = input_address
        self.output_address = output_address
        self.engine_count = engine_count
        self.client_index = client_index
        self.ready_timeout = ready_timeout
        # request id -> (engine index, its reader's collector, the client's id for it)
        self._collectors: dict[str, tuple[int, Collector, str | None]] = {}
        self._push_queue = PushQueue()
        self._load = [0] * engine_count
        self._rr = 0
        self._listeners: list[OutputListener] = []
        self._identities = [identity_for(r) for r in range(engine_count)]
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs, ext_hook=_ext_hook)
        self._ctx: zmq.asyncio.Context | None = None
        self._input: zmq.Socket | None = None
        self._output: zmq.Socket | None = None
        self._output_reader: FrameReader | None = None  # reads the output socket from the event loop
        self._ready = asyncio.Event()
        self.dead: EngineDeadError | None = None
        self.startup_error: str | None = None
        self._on_dead: list[Callable[[], None]] = []
        self._stopping = False
        self._calls: dict[int, asyncio.Future] = {}  # utility call id -> its answer
        self._call_ids = itertools.count(1)
        self.ready_payloads: dict[int, dict[str, Any]] = {}  # rank -> what the engine announced itself with

    # --- lifecycle -----------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind the input and output sockets (the engines connect to them)."""
        ctx = self._ctx = zmq.asyncio.Context()
        sync = zmq.Context.shadow(ctx.underlying)
        self._input = sync.socket(zmq.ROUTER)  # sends happen synchronously, from the request path
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.RCVHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an engine that is gone: an error, not a silent drop
        self._input.bind(self.input_address)
        self._output = sync.socket(zmq.PULL)  # read by a FrameReader (reader.py)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)
        self._output_reader = FrameReader(self._output, self._on_output, self._on_output_error,
                                    what=f"API server {self.client_index}: engine outputs", copy=False)

    async def start(self) -> None:
        """Wait for every engine's ready payload, then read outputs."""
        if self._input is None:
            self.bind()
        waiting = set(self._identities)
        poller = zmq.asyncio.Poller()
        shadow = zmq.asyncio.Socket.shadow(self._input.underlying)
        poller.register(shadow, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        try:
            while waiting:
                left = deadline - loop.time()
                if left <= 0 or not await poller.poll(left * 1000):
                    raise EngineDeadError(f"engine(s) {sorted(int.from_bytes(i, 'little') for i in waiting)} "
                                          f"did not announce themselves in {self.ready_timeout:g} s")
                frames = self._input.recv_multipart(zmq.NOBLOCK)
                if frames[0] in waiting:
                    waiting.discard(frames[0])
                    try:
                        payload = msgspec.msgpack.decode(frames[-1])
                    except msgspec.DecodeError:
                        payload = None
                    rank = int.from_bytes(frames[0], "little")
                    self.ready_payloads[rank] = payload if isinstance(payload, dict) else {}
        finally:
            poller.unregister(shadow)
        self._output_reader.start(loop)
        self._ready.set()

    async def stop(self, timeout: float | None = None) -> None:
        """The engines drain or abort on their own (their process got the signal): wait until every
        request of this API server has ended, or the engines are gone, or (an engine killed
        outright answers nothing) STOP_GRACE after --shutdown-timeout; what is left then fails."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(getattr(self.args, "shutdown_timeout", 0.0) or 0.0) + STOP_GRACE
        while self._collectors and self.dead is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._collectors and self.dead is None:
            log.warning("API server %d: %d request(s) unanswered by the engine cores; giving up on them",
                        self.client_index, len(self._collectors))
            self._engine_dead()

    def close(self) -> None:
        if self._output_reader is not None:
            self._output_reader.stop()
        for s in (self._input, self._output):
            if s is not None and not s.closed:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.dead is None

    async def wait_ready(self) -> None:
        await self._ready.wait()
        if self.dead is not None:
            raise self.dead

    @property
    def is_running(self) -> bool:
        return self._ready.is_set() and self.dead is None

    @property
    def errored(self) -> bool:
        return self.dead is not None

    def on_dead(self, callback: Callable[[], None]) -> None:
        """`callback` runs once, when an engine is found dead (vLLM's API server then shuts down)."""
        self._on_dead.append(callback)

    @property
    def num_unfinished_requests(self) -> int:
        return sum(self._load)

    def add_output_listener(self, listener: OutputListener, token_observer: Any = None) -> None:
        """Every token arrives in an engine batch here, so token observers are never needed."""
        self._listeners.append(listener)

    @property
    def engines(self) -> list[Any]:
        """The engine objects: none in this process (what acts on them directly answers a 500)."""
        raise HTTPError(500, NOT_IN_THIS_PROCESS, "InternalServerError")

    async def call_all(self, fn: Callable[[Any], Any]) -> list[Any]:
        raise HTTPError(500, NOT_IN_THIS_PROCESS, "InternalServerError")

    async def utility(self, method: str, *args: Any, return_exceptions: bool = False) -> list[Any]:
        """vLLM's utility call (engine-core protocol): `method` on every engine, their answers in
        rank order (the first failure raised, or with `return_exceptions` each in its place)."""
        if self.dead is not None:
            raise self.dead
        loop = asyncio.get_running_loop()
        calls = []
        for ident in self._identities:
            call_id = next(self._call_ids)
            fut = self._calls[call_id] = loop.create_future()
            calls.append(fut)
            body = self._encoder.encode([self.client_index, call_id, method, list(args)])
            self._input.send_multipart((ident, UTILITY, body))
        return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))

    def abort_tracked(self, external_ids: set[str] | None) -> list[tuple[str, str | None]]:
        """vLLM's /abort_requests in one API server: this API server's requests (every one, or
        those whose client id is in `external_ids`) are aborted in their engines and end here with
        finish_reason abort, as vLLM's output processor ends them. Returns (request id, client id) of each."""
        chosen: dict[int, list[str]] = {}
        for rid, (idx, _, ext) in self._collectors.items():
            if external_ids is None or ext in external_ids:
                chosen.setdefault(idx, []).append(rid)
        now = time.monotonic()
        for idx, rids in chosen.items():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send_multipart((self._identities[idx], ABORT, self._encoder.encode(rids)))
            self._deliver(EngineCoreOutputs(
                engine_index=idx, timestamp=now, finished_requests=rids,
                outputs=[EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT)
                         for rid in rids]))
        return [(rid, self._collectors[rid][2]) for rids in chosen.values() for rid in rids]

    async def reset_prefix_cache(self) -> list[bool]:
        """AsyncEngine.reset_prefix_cache, over the wire."""
        return [r is not False for r in await self.utility("reset_prefix_cache")]

    async def loads(self) -> list[dict[str, Any]]:
        """AsyncEngine.loads, over the wire (vllm-vcr's own utility method, not one of vLLM's)."""
        return await self.utility("vcr_load")

    # --- outputs -------------------------------------------------------------------------------
    def _on_output(self, frames: list) -> None:
        buf = frames[0].buffer
        if len(frames) == 1 and buf == ENGINE_CORE_DEAD:
            self._output_reader.stop()
            if self._collectors or self._stopping:  # (else the engines stopped with nothing of ours in flight)
                log.log(logging.INFO if self._stopping else logging.ERROR, "API server %d: %s",
                        self.client_index, "the engine cores have stopped" if self._stopping else
                        f"an engine core is dead; failing {len(self._collectors)} request(s)")
            else:
                log.info("API server %d: the engine cores have stopped", self.client_index)
            self._engine_dead()
            return
        try:
            outs = self._decoder.decode(buf)
        except msgspec.DecodeError as e:
            log.warning("API server %d: undecodable engine output ignored: %s", self.client_index, e)
            return
        self._deliver(outs)

    def _on_output_error(self, e: zmq.ZMQError) -> None:
        if not self._output.closed:
            log.error("API server %d: output socket failed: %s", self.client_index, e)
            self._engine_dead()

    def _deliver(self, outs: EngineCoreOutputs) -> None:
        if outs.utility_output is not None:
            self._answer(outs.utility_output)
        deliver_outputs(outs.engine_index, outs, self._listeners, self._collectors)

    def _answer(self, u: Any) -> None:
        fut = self._calls.pop(u.call_id, None)
        if fut is None or fut.done():
            return
        if u.failure_message is not None:
            fut.set_exception(UtilityError(u.failure_message))
        else:
            fut.set_result(u.result[1] if isinstance(u.result, (list, tuple)) and len(u.result) > 1 else None)

    def _engine_dead(self) -> None:
        if self.dead is not None:
            return
        self.dead = EngineDeadError(ENGINE_DEAD_MESSAGE)
        for _, col, _ in list(self._collectors.values()):
            col.fail(self.dead)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._calls.clear()
        self._ready.set()
        for cb in self._on_dead:
            try:
                cb()
            except Exception:
                log.exception("engine-death callback failed")

    # --- requests ------------------------------------------------------------------------------
    def pick_engine(self, request: EngineCoreRequest) -> int:
        idx, self._rr = pick_engine_index(request.data_parallel_rank, self._load, self._rr)
        return idx

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Submit a request and yield its outputs; leaving early aborts it in the engine."""
        col = Collector()
        idx = self._submit(request, col)
        try:
            while True:
                out = await col.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            self._detach(idx, request.request_id, col)

    async def push(self, request: EngineCoreRequest, deliver: Callable[[EngineCoreOutput], bool],
                   take: TakeToken | None = None, batch_reader: Any = None) -> AsyncIterator[None]:
        """AsyncEngine.push: outputs go to `deliver`, merged per turn of the event loop (`take` and
        `batch_reader` are the in-process engine's shortcuts; every token arrives in a batch here)."""
        col = Collector(deliver, self._push_queue)
        idx = self._submit(request, col)
        try:
            while True:
                await col.wait()
                yield None
                if col.finished and col.pending is None:
                    return
        finally:
            self._detach(idx, request.request_id, col)

    def _submit(self, request: EngineCoreRequest, col: Collector) -> int:
        if self.dead is not None:
            raise self.dead
        if not self._ready.is_set():
            raise EngineDeadError("the engine cores have not started")
        idx = self.pick_engine(request)
        request.client_index = self.client_index
        rid = request.request_id
        self._collectors[rid] = (idx, col, request.external_req_id)
        self._load[idx] += 1
        try:
            self._input.send_multipart((self._identities[idx], ADD, self._encoder.encode(request)), copy=False)
        except zmq.ZMQError as e:
            self._load[idx] -= 1
            del self._collectors[rid]
            log.error("API server %d: cannot reach engine %d: %s", self.client_index, idx, e)
            self._engine_dead()
            raise self.dead from None
        return idx

    def _detach(self, idx: int, rid: str, col: Collector) -> None:
        self._load[idx] -= 1
        if self._collectors.get(rid, (None, None, None))[1] is col:
            del self._collectors[rid]
        if not col.finished and self.dead is None:
            try:
                self._input.send_multipart((self._identities[idx], ABORT, self._encoder.encode([rid])))
            except zmq.ZMQError:
                pass
