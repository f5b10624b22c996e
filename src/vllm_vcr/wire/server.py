"""`vllm-vcr play`: EngineCores behind vLLM's engine-core sockets, all in one event loop.

One `EngineBridge` per DP rank owns that rank's sockets and its EngineCore: input frames become
`add_request` / `abort_requests` / utility answers; the core's `output_sink` encodes each batch
once and pushes it to `outputs[client_index]`. `PlayServer` runs the handshakes, the cores, the
optional control API, and the shutdown: drain or abort, then ENGINE_CORE_DEAD on every output
socket so the frontend fails fast instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from ..control.server import start_control_server
from ..engine.clock import RealClock
from ..engine.config import ConfigError, EngineArgs
from ..replay.inputs import engine_inputs
from ..engine.core import EngineCore
from ..engine.lockstep import DataParallelLockstep
from ..engine.sleep import PAUSED_MESSAGE, EngineSleep, SleepConfig
from .lockstep import LockstepLink
from ..gc_tuning import collect_while_idle
from ..heap_trim import start_idle_trimming
from ..engine.types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from ..kv_events import KVEventCollector, KVEventPublisher, KVEventsConfig, NullEventPublisher, create_publisher
from ..pd import start_pd_services
from . import utility
from .codec import (
    ABORT,
    ADD,
    COORDINATOR_READY,
    ENGINE_CORE_DEAD,
    REQUEST_TYPE_NAMES,
    START_DP_WAVE,
    UTILITY,
    Codec,
    FrameError,
    error_output,
    utility_failure,
    utility_success,
)
from .handshake import EngineSockets, ReadyInfo, handshake
from .logprobs import LogprobsAttacher
from .reader import FrameReader

log = logging.getLogger("vllm_vcr.wire")


class _RateLimitedWarning:
    """Malformed frames are logged with their reason, but a flood must not flood the log."""

    def __init__(self, logger: logging.Logger, burst: int = 20, every: int = 1000):
        self.logger, self.burst, self.every, self.count = logger, burst, every, 0

    def __call__(self, msg: str, *args: Any) -> None:
        self.count += 1
        if self.count <= self.burst or self.count % self.every == 0:
            suffix = f" [{self.count} so far]" if self.count > self.burst else ""
            self.logger.warning(msg + suffix, *args)


class EngineBridge:
    """One DP rank: its sockets, its EngineCore, and the wire-side state utilities need."""

    def __init__(self, rank: int, sockets: EngineSockets, codec: Codec, vocab_size: int = 32000):
        self.rank = rank
        self.sockets = sockets
        self.codec = codec
        self.logprobs = LogprobsAttacher(vocab_size)  # requests that asked for logprobs
        self.core: EngineCore | None = None  # set by attach_core (the core needs our sink to be built)
        # request id -> client index, for every request the engine owes an answer
        self.inflight: dict[str, int] = {}
        # the engine core's pause and sleep state (engine/sleep.py), set once the core is attached;
        # the sleep and pause utility calls act on it (utility.py)
        self.sleep: EngineSleep | None = None
        self.loras: dict[int, str] = {}
        self.weight_version = "default"
        self.listeners: list[Callable[[int, EngineCoreOutputs], None]] = []
        self._last_counts: tuple[int, int] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._bad = _RateLimitedWarning(log)
        self._dead_sent = False
        self.closing = False

    def attach_core(self, core: EngineCore) -> None:
        self.core = core

    def cancel_utility_calls(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    # ---- outputs (called synchronously from the engine loop; must not block) ----------------
    def sink(self, client_index: int, outs: EngineCoreOutputs) -> None:
        outs.engine_index = self.rank
        if self.logprobs.requests:
            for o in outs.outputs:
                self.logprobs.attach(o)
        inflight = self.inflight
        if inflight:
            for o in outs.outputs:
                if o.finish_reason is not None:
                    inflight.pop(o.request_id, None)
            if outs.finished_requests:
                for rid in outs.finished_requests:
                    inflight.pop(rid, None)
        self._send(client_index, outs)
        if self.sockets.coordinator_out is not None and outs.scheduler_stats is not None:
            self._publish_counts(outs.scheduler_stats)
        for cb in self.listeners:
            try:
                cb(self.rank, outs)
            except Exception:
                log.exception("output listener failed")

    def _send(self, client_index: int, outs: EngineCoreOutputs) -> None:
        outputs = self.sockets.outputs
        if not 0 <= client_index < len(outputs):
            self._bad("engine %d: output for client %d, but the frontend has %d output socket(s); dropped",
                      self.rank, client_index, len(outputs))
            return
        if self._dead_sent:
            return
        try:
            outputs[client_index].send(self.codec.encode(outs), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # HWM is 0, so only a closed socket gets here
            self._bad("engine %d: could not send to client %d: %s", self.rank, client_index, e)

    def _publish_counts(self, stats: SchedulerStats) -> None:
        # The DP coordinator balances on (running, waiting); it wants a stats-only message
        # whenever they change (vllm-protocol.md §6).
        counts = (stats.num_running_reqs, stats.num_waiting_reqs)
        if counts == self._last_counts:
            return
        self._last_counts = counts
        msg = EngineCoreOutputs(
            engine_index=self.rank, timestamp=time.monotonic(),
            scheduler_stats=SchedulerStats(num_running_reqs=counts[0], num_waiting_reqs=counts[1],
                                           kv_cache_usage=stats.kv_cache_usage,
                                           step_counter=stats.step_counter, current_wave=stats.current_wave))
        try:
            self.sockets.coordinator_out.send(self.codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._bad("engine %d: could not publish counts to the DP coordinator: %s", self.rank, e)

    def answer_directly(self, client_index: int, outputs: list[EngineCoreOutput]) -> None:
        """Finish requests the engine never saw (undecodable, refused while paused)."""
        for o in outputs:
            self.inflight.pop(o.request_id, None)
        if self.logprobs.requests:
            self.logprobs.discard(o.request_id for o in outputs)
        self._send(client_index, EngineCoreOutputs(
            engine_index=self.rank, outputs=outputs, timestamp=time.monotonic(),
            finished_requests=[o.request_id for o in outputs]))

    def send_dead(self) -> None:
        """Tell every frontend client this engine is gone (else it waits forever)."""
        if self._dead_sent:
            return
        for s in self.sockets.outputs:
            try:
                s.send(ENGINE_CORE_DEAD, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._dead_sent = True

    # ---- inputs ------------------------------------------------------------------------------
    async def serve_input(self, index: int, sock: zmq.asyncio.Socket) -> None:
        """Read input `index` until the socket closes (or this task is cancelled): every message
        waiting, per turn of the loop (reader.py); a socket error is logged, and reading resumes
        after 0.1 s."""
        loop = asyncio.get_running_loop()
        closed = loop.create_future()
        raw = zmq.Socket.shadow(sock.underlying)  # (the asyncio socket's only use was the handshake's send)

        def failed(e: zmq.ZMQError) -> None:
            if self.closing or sock.closed:
                if not closed.done():
                    closed.set_result(None)
                return
            log.error("engine %d: input socket %d failed: %s", self.rank, index, e)
            loop.call_later(0.1, retry)

        def retry() -> None:
            if not closed.done():  # (done: the socket closed, or this task was cancelled)
                reader.start(loop)

        reader = FrameReader(raw, lambda frames: self.on_frames(index, frames), failed,
                             what=f"engine {self.rank}: input {index}")
        reader.start(loop)
        try:
            await closed
        finally:
            reader.stop()

    def on_frames(self, index: int, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._bad("engine %d: %d-frame message on input %d, expected [type, body, ...]; ignored",
                      self.rank, len(frames), index)
            return
        kind = frames[0]
        if kind == ADD:
            self._on_add(index, frames[1:])
        elif kind == ABORT:
            try:
                ids = self.codec.decode_abort(frames[1:])
            except FrameError as e:
                self._bad("engine %d: bad ABORT ignored: %s", self.rank, e)
                return
            self.abort(ids)
        elif kind == UTILITY:
            try:
                client, call_id, method, args = self.codec.decode_utility(frames[1:])
            except FrameError as e:
                self._bad("engine %d: bad UTILITY ignored: %s", self.rank, e)
                return
            if not 0 <= client < len(self.sockets.outputs):
                client = index
            self._spawn(self._utility(client, call_id, method, args))
        elif kind == START_DP_WAVE:
            pass  # non-MoE data parallel has no waves
        else:
            name = REQUEST_TYPE_NAMES.get(bytes(kind), repr(bytes(kind[:8])))
            self._bad("engine %d: unexpected request type %s on input %d; ignored", self.rank, name, index)

    def _on_add(self, index: int, frames: list[bytes]) -> None:
        try:
            req = self.codec.decode_add(frames)
        except FrameError as e:
            self._bad("engine %d: bad ADD%s: %s", self.rank,
                      f" {e.request_id}" if e.request_id else "", e)
            if e.request_id:
                client = e.client_index if e.client_index < len(self.sockets.outputs) else index
                code = "validation_error" if "prompt" in str(e) else "internal_error"
                self.answer_directly(client, [error_output(e.request_id, f"vllm-vcr: {e}", code=code)])
            return
        if not 0 <= req.client_index < len(self.sockets.outputs):
            req.client_index = index  # inputs[i] and outputs[i] belong to the same API server
        if req.abort_immediately:
            return  # KV-transfer cleanup: added and aborted at once, produces nothing
        if self.sleep is not None and self.sleep.reject_new:  # 0.33's user pause (abort, wait)
            self.answer_directly(req.client_index, [error_output(
                req.request_id, PAUSED_MESSAGE, code="engine_paused", retryable=True)])
            return
        self.inflight[req.request_id] = req.client_index
        self.logprobs.add(req)
        self.core.add_request(req)  # (while paused or asleep it waits there, unscheduled)

    def abort(self, ids: list[str]) -> None:
        """Client ABORT: idempotent; unknown or finished ids are ignored."""
        if not ids:
            return
        for rid in ids:
            self.inflight.pop(rid, None)
        if self.logprobs.requests:
            self.logprobs.discard(ids)
        self.core.abort_requests(ids)

    async def serve_coordinator(self) -> None:
        sock = self.sockets.coordinator_in
        while sock is not None:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                if self.closing or sock.closed:
                    return
                await asyncio.sleep(0.1)
                continue
            if frames and frames[-1] == COORDINATOR_READY:
                continue  # repeated READY after startup
            if frames and frames[0] == START_DP_WAVE:
                continue  # waves are a MoE-only protocol
            self._bad("engine %d: unexpected %d-frame message from the DP coordinator; ignored",
                      self.rank, len(frames))

    # ---- utilities ---------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _utility(self, client: int, call_id: int, method: str, args: list) -> None:
        ok, value = await utility.dispatch(self, method, args)
        now = time.monotonic()
        msg = (utility_success(self.rank, call_id, value, now) if ok
               else utility_failure(self.rank, call_id, value, now))
        try:
            self._send(client, msg)
        except Exception as e:  # noqa: BLE001 - e.g. a value msgpack cannot carry
            self._send(client, utility_failure(self.rank, call_id, f"Call to {method} method failed: {e}", now))

    async def start(self) -> list[asyncio.Task]:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self.serve_input(i, s), name=f"engine{self.rank}-input{i}")
                 for i, s in enumerate(self.sockets.inputs)]
        if self.sockets.coordinator_in is not None:
            tasks.append(loop.create_task(self.serve_coordinator(), name=f"engine{self.rank}-coordinator"))
        return tasks


class PlayEngines:
    """What the control API sees: the play process's EngineCores, AsyncEngine-shaped."""

    def __init__(self, bridges: list[EngineBridge]):
        self.bridges = bridges

    @property
    def engines(self) -> list[EngineCore]:  # what control.server reads
        return [b.core for b in self.bridges if b.core is not None]

    @property
    def engine_count(self) -> int:
        return len(self.bridges)

    async def call_all(self, fn: Callable[[Any], Any]) -> list[Any]:
        futs = [b.core.call(fn) for b in self.bridges]
        return [await utility.await_call(f) for f in futs]

    def add_output_listener(self, cb: Callable[[int, EngineCoreOutputs], None]) -> None:
        for b in self.bridges:
            b.listeners.append(cb)


class _StartFailed(Exception):
    """A start-up phase failed (already logged); `run` returns this exit code."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


class PlayServer:
    """One run of `vllm-vcr play`: one method per phase, unwound by an exit stack."""

    def __init__(self, args: EngineArgs, *, handshake_address: str, engine_count: int = 1,
                 ready: ReadyInfo, handshake_timeout: float = 300.0, control_address: str | None = None,
                 control_token: str | None = None,
                 kv_events: KVEventsConfig | None = None, pd_args: Any = None,
                 token_source_factory: Any = None, textless_ids: frozenset[int] = frozenset(),
                 first_rank: int = 0, data_parallel_size: int | None = None, lockstep_address: str | None = None,
                 sleep_config: SleepConfig | None = None, dead_after_stop: bool = True,
                 attach: Callable[["PlayServer", contextlib.AsyncExitStack], None] | None = None):
        self.args = args
        # this process's engines are DP ranks first_rank.. of data_parallel_size (one process per
        # rank behind `serve --api-server-count`; all ranks in one process for `play`)
        self.first_rank = first_rank
        self.data_parallel_size = data_parallel_size or first_rank + engine_count
        # the DP lockstep coordinator of the ranks in other processes (wire/lockstep.py): an MoE
        # model's rank steps with them through it
        self.lockstep_address = lockstep_address
        self.lockstep_link: LockstepLink | None = None
        self.ctx: zmq.asyncio.Context | None = None
        self.control: Any = None  # the control API's server, once it runs
        # each engine's sleep and pause state (engine/sleep.py's EngineSleep over that one engine);
        # serve's --enable-sleep-mode times for its engine-core processes
        self.sleep_config = sleep_config or SleepConfig()
        # ENGINE_CORE_DEAD after a stop on a signal too (`play`: a frontend that outlives its engine
        # fails fast); without, only when an engine failed, as vLLM's engine core (`serve`'s engine
        # cores: the other ranks of the same API servers may still be draining)
        self.dead_after_stop = dead_after_stop
        # called once the engines exist, before they serve (what observes them: forward-pass metrics);
        # an exception fails the start-up
        self.attach = attach
        # called once the engines serve (after the handshake): a parent process learns that it can go on
        self.on_serving: Callable[[PlayServer], None] | None = None
        self.token_source_factory = token_source_factory  # --tokenizer: structured outputs honoured
        self.textless_ids = textless_ids  # ids random output skips (MODEL's specials, or below the safe range)
        self.engine_inputs: dict[str, Any] = {}  # built from the trace flags before the handshake
        self.pd_args = pd_args  # the parsed CLI: P/D side channel and bootstrap settings
        self.address = handshake_address
        self.engine_count = engine_count
        self.ready = ready
        self.handshake_timeout = handshake_timeout
        self.control_address = control_address
        self.control_token = control_token
        self.kv_events = kv_events
        self.publishers: list[KVEventPublisher | NullEventPublisher] = []
        self.codec = Codec()
        self.bridges: list[EngineBridge] = []
        self.engines = PlayEngines(self.bridges)
        self._stop = asyncio.Event()
        self._signals = 0
        self._shutdown_timeout = args.shutdown_timeout

    # Signals: the first one drains (or aborts, with --shutdown-timeout 0); a second aborts now.
    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals == 1:
            log.info("%s: shutting down (%s)", name,
                     f"draining up to {self._shutdown_timeout:g} s" if self._shutdown_timeout > 0 else "aborting all requests")
        else:
            log.info("%s again: aborting all requests now", name)
            self._shutdown_timeout = 0.0
            for b in self.bridges:
                if b.core is not None:
                    b.core.shutdown(timeout=0.0)
        self._stop.set()

    async def run(self) -> int:
        self.install_signal_handlers()
        try:
            self.check_inputs()
            async with contextlib.AsyncExitStack() as stack:
                # the control API and the KV-event endpoints bind before HELLO: a bad address fails
                # before the frontend has spent its one handshake on us
                await self.start_control_api(stack)
                self.start_kv_publishers(stack)
                ctx = self.open_zmq(stack)
                if not await self.handshake(ctx):
                    return 0
                self.create_engines()
                self.attach_to_engines(stack)
                await self.start_pd_services(stack)
                core_tasks, io_tasks = await self.start_serving()
                if self.on_serving is not None:
                    self.on_serving(self)
                start_idle_trimming(stack, lambda: self.engines.engines)
                rc = await self.serve_until_signal(core_tasks)
                await self.drain(core_tasks, io_tasks, failed=rc != 0)
                return rc
        except _StartFailed as e:
            return e.exit_code

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform
                pass

    def check_inputs(self) -> None:
        try:
            # load and check every input file before the frontend's one handshake
            self.engine_inputs = engine_inputs(self.args)
        except ConfigError as e:
            log.error("%s", e)
            raise _StartFailed(2) from None

    async def start_control_api(self, stack: contextlib.AsyncExitStack) -> None:
        """Until the engines exist the control API answers "no engine"."""
        if not self.control_address:
            return
        control = self.control = await start_control_server(self.engines, self.control_address,
                                                            token=self.control_token)
        stack.push_async_callback(_stop_quietly, control.stop, "the control API")
        log.info("control API on %s", self.control_address)

    def start_kv_publishers(self, stack: contextlib.AsyncExitStack) -> None:
        if self.kv_events is None or not self.kv_events.active:
            return
        for rank in self.ranks:
            pub = create_publisher(self.kv_events, data_parallel_rank=rank)
            stack.callback(pub.close)
            self.publishers.append(pub)

    def open_zmq(self, stack: contextlib.AsyncExitStack) -> zmq.asyncio.Context:
        ctx = self.ctx = zmq.asyncio.Context()

        def close() -> None:
            if self.lockstep_link is not None:
                self.lockstep_link.close()
            for b in self.bridges:
                b.sockets.close(linger_ms=2000)
            ctx.term()

        stack.callback(close)
        return ctx

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.engine_count)

    def _ready_info(self, rank: int) -> ReadyInfo:
        info = copy.copy(self.ready)
        base = info.instance_id or self.args.engine_id
        info.instance_id = base if rank == 0 else f"{base}-{rank}"
        info.data_parallel_size = self.data_parallel_size
        if self.publishers:
            cfg = self.publishers[rank - self.first_rank].publisher_config
            info.kv_events_config = cfg.to_dict() if cfg is not None else None
        return info

    async def handshake(self, ctx: zmq.asyncio.Context) -> bool:
        """All ranks at once (the DP coordinator waits for every engine); False: stopped first."""
        load_time = self.args.startup_time / self.args.time_scale
        hs = asyncio.gather(*(handshake(ctx, self.address, r, self._ready_info(r), timeout=self.handshake_timeout,
                                        load_time=load_time, load_failure=self.args.startup_failure)
                              for r in self.ranks), return_exceptions=True)
        stop_wait = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({hs, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if hs not in done:
            hs.cancel()
            await asyncio.gather(hs, return_exceptions=True)
            log.info("stopped before the handshake finished")
            return False
        stop_wait.cancel()
        results = hs.result()
        for r in results:
            if isinstance(r, EngineSockets):
                self.bridges.append(EngineBridge(r.rank, r, self.codec, self.args.vocab_size))
        failed = [r for r in results if isinstance(r, BaseException)]
        for e in failed:
            log.error("handshake failed: %s", e)
        if failed:
            self._fail_start()
        return True

    def _fail_start(self) -> None:
        for b in self.bridges:
            b.send_dead()  # the frontend is waiting for us: tell it, do not leave it hanging
        raise _StartFailed(1)

    def create_engines(self) -> None:
        try:
            for b in self.bridges:
                eargs = copy.deepcopy(self.args)
                eargs.engine_id = self._ready_info(b.rank).instance_id
                b.attach_core(EngineCore(eargs, engine_index=b.rank, clock=RealClock(), output_sink=b.sink,
                                         token_source_factory=self.token_source_factory, on_idle=collect_while_idle,
                                         textless_ids=self.textless_ids, **self.engine_inputs))
                if self.publishers:
                    b.core.attach_kv_events(KVEventCollector(), self.publishers[b.rank - self.first_rank].publish)
            # an MoE model's DP ranks step together, as in vLLM (the ranks of this process)
            DataParallelLockstep.attach([b.core for b in self.bridges])
            if self.lockstep_address and len(self.bridges) == 1:  # (and with the ranks of other processes)
                b = self.bridges[0]
                self.lockstep_link = LockstepLink.attach(self.ctx, self.lockstep_address, b.rank, b.core)
        except Exception:
            log.exception("could not build the engines")
            self._fail_start()

    def attach_to_engines(self, stack: contextlib.AsyncExitStack) -> None:
        for b in self.bridges:
            b.sleep = EngineSleep(PlayEngines([b]), self.sleep_config)
        if self.attach is None:
            return
        try:
            self.attach(self, stack)
        except Exception as e:
            log.error("%s", e)
            self._fail_start()

    async def start_pd_services(self, stack: contextlib.AsyncExitStack) -> None:
        try:
            pd = await start_pd_services([b.core for b in self.bridges], self.pd_args)
        except OSError as e:
            log.error("%s", e)
            self._fail_start()
        stack.push_async_callback(pd.stop)

    async def start_serving(self) -> tuple[dict[asyncio.Task, EngineBridge], list[asyncio.Task]]:
        core_tasks = {loop_task(b.core.run(), f"engine{b.rank}-core"): b for b in self.bridges}
        io_tasks: list[asyncio.Task] = []
        for b in self.bridges:
            io_tasks.extend(await b.start())
        if self.lockstep_link is not None:
            io_tasks.append(loop_task(self.lockstep_link.run(), "lockstep"))
            for t in core_tasks:
                t.add_done_callback(self.lockstep_link.stopped)
        log.info("serving %d engine(s) behind %s", self.engine_count, self.address)
        return core_tasks, io_tasks

    async def serve_until_signal(self, core_tasks: dict[asyncio.Task, EngineBridge]) -> int:
        """Until a signal or an engine dies (exit code 1, and the drain becomes an abort)."""
        stop_wait = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({stop_wait, *core_tasks}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        rc = 0
        for t in done:
            if t is stop_wait:
                continue
            err = t.exception() if not t.cancelled() else None
            log.error("engine %d stopped unexpectedly%s", core_tasks[t].rank, f": {err!r}" if err else "")
            rc = 1
        if rc:
            self._shutdown_timeout = 0.0
        return rc

    async def drain(self, core_tasks: dict[asyncio.Task, EngineBridge], io_tasks: list[asyncio.Task],
                    failed: bool = False) -> None:
        """Drain or abort, flush, then ENGINE_CORE_DEAD on every output socket."""
        for b in self.bridges:
            b.closing = True  # (a paused engine stays paused: what it holds ends with the timeout, as in vLLM)
            if not core_tasks_done(b, core_tasks):
                b.core.shutdown(timeout=self._shutdown_timeout)
        pending = [t for t in core_tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=self._shutdown_timeout + 10.0)
            for t in still:
                log.error("engine %d did not stop in time; cancelling it", core_tasks[t].rank)
                t.cancel()
        for t in io_tasks:
            t.cancel()
        await asyncio.gather(*io_tasks, return_exceptions=True)
        for b in self.bridges:
            b.cancel_utility_calls()
        if not (failed or self.dead_after_stop):
            log.info("engines stopped")
            return
        for b in self.bridges:
            b.send_dead()
        log.info("engines stopped; ENGINE_CORE_DEAD sent to the frontend")


def loop_task(coro, name: str) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coro, name=name)


def core_tasks_done(b: EngineBridge, core_tasks: dict[asyncio.Task, EngineBridge]) -> bool:
    return any(t.done() for t, bb in core_tasks.items() if bb is b)


async def _stop_quietly(stop: Callable[[], Awaitable[None]], what: str) -> None:
    try:
        await stop()
    except Exception:
        log.exception("stopping %s failed", what)
