"""`serve --api-server-count N` (N >= 2, or the default N = D with `--data-parallel-size D` > 1):
vLLM's process shape.

A parent process claims the port, starts one engine-core process per data-parallel rank (the
engine-core of `play`: wire/server.py's PlayServer) and N API server processes, and supervises
them, as vLLM's `run_multi_api_server` does:

    parent ── handshake (ROUTER) ── engine-core rank 0 .. D-1   (one process each)
      │                                 │ DEALER -> each API server's input (ROUTER)
      │                                 │ PUSH   -> each API server's output (PULL)
      └─ API server 0 .. N-1 (one process each, all accepting on the one socket of --port)

Each API server is `serve` itself (server.py's _ServeCommand) whose engine is an engine-core
client (wire/client.py) instead of the in-process AsyncEngine; responses are rendered by the same
code. `/metrics` is aggregated across the API servers through a prometheus multiprocess
directory (vllm/metrics_multiproc.py); --control-address is served by the parent and fanned out
to the engine-core processes (control/fanout.py); KV events and forward-pass metrics come from
the engine-core processes (one endpoint per rank), and sleep, pause and the weight version are
theirs too, reached with vLLM's utility calls (wire/utility.py, engine/sleep.py).
With D >= 2 the parent also runs the ranks' lockstep coordinator (wire/lockstep.py: vLLM's DP
coordinator), which the engine cores of an MoE model step through.

Signals: the first SIGTERM/SIGINT is passed on to every child (the engines drain with
--shutdown-timeout, the API servers let open responses finish), a second one aborts. A child that
dies takes the others down and the parent exits 1, as vLLM's parent does: an engine core that
fails in its loop first sends ENGINE_CORE_DEAD (the API servers' requests then fail with vLLM's
EngineDeadError 500); one that is killed outright says nothing, and the API servers are stopped
with SIGTERM, dropping what is in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .. import event_loop
from ..listen_socket import bind_listener
from .settings import CLIError

logger = logging.getLogger("vllm_vcr.serve")

API_SERVER_HEADER = "x-vllm-vcr-api-server"  # which API server answered: "<index>" (multi-process serve only)
STARTUP_TIMEOUT = 300.0  # s: engine-core processes must finish their handshake by then
EXIT_GRACE = 15.0  # s beyond --shutdown-timeout before a child that does not exit is killed
PR_SET_PDEATHSIG = 1


@dataclass
class Layout:
    """Where the processes meet (ipc paths in a private directory)."""

    handshake: str
    inputs: list[str]
    outputs: list[str]
    metrics_dir: str
    faults: str  # the HTTP faults' shared state (faults/shared.py)
    lockstep: str | None = None  # the DP lockstep coordinator (wire/lockstep.py), with two ranks or more


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _die_with_parent() -> None:
    """A child must not outlive a parent killed without a chance to stop it (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(args: argparse.Namespace) -> None:
    _die_with_parent()
    os.setpgrp()  # a terminal's Ctrl-C reaches the parent only; it passes the signal on
    from ..logging_setup import apply_log_level, install_reloadable_logging

    install_reloadable_logging()
    apply_log_level(getattr(args, "log_level", None))


# ------------------------------------------------------------------------------------------------
# engine-core process

def _engine_core_main(args: argparse.Namespace, engine_args: Any, rank: int, engine_count: int,
                      handshake: str, textless_ids: frozenset[int], control_address: str | None,
                      model_name: str, report: Connection, lockstep: str | None = None) -> None:
    _child_setup(args)
    from ..frontend.planned_output import planned_token_source
    from ..gc_tuning import tune_for_serving
    from ..kv_events import kv_events_config_from_cli
    from ..engine.sleep import SleepConfig
    from ..wire.handshake import ReadyInfo
    from ..wire.server import PlayServer
    from .server import attach_forward_pass_metrics

    sleep = SleepConfig.from_cli(args)  # (checked by the parent already)
    kv_config = None
    if args.kv_events_config is not None or args.enable_kv_cache_events:
        kv_config = kv_events_config_from_cli(args)  # (checked by the parent already)
    ready = ReadyInfo(max_model_len=engine_args.config.max_model_len or 1_048_576,
                      num_gpu_blocks=engine_args.kv_cache_size, block_size=engine_args.tokens_per_block,
                      max_num_seqs=engine_args.config.max_num_seqs,
                      max_num_batched_tokens=engine_args.config.max_num_batched_tokens,
                      instance_id=engine_args.engine_id)
    server = PlayServer(engine_args, handshake_address=handshake, engine_count=1, ready=ready,
                        handshake_timeout=STARTUP_TIMEOUT, control_address=control_address,
                        control_token=getattr(args, "control_token", None), kv_events=kv_config, pd_args=args,
                        token_source_factory=planned_token_source(engine_args.vocab_size),
                        textless_ids=textless_ids, first_rank=rank, data_parallel_size=engine_count,
                        lockstep_address=lockstep, sleep_config=sleep, dead_after_stop=False,
                        attach=lambda s, stack: attach_forward_pass_metrics(
                            [b.core for b in s.bridges], args, model_name, engine_args, stack,
                            shared_trace=engine_count > 1))

    def serving(s: PlayServer) -> None:
        report.send({"rank": rank, "pid": os.getpid(), "control": s.control.url if s.control is not None else None})

    server.on_serving = serving
    tune_for_serving()
    try:
        rc = event_loop.run(server.run())
    except KeyboardInterrupt:
        rc = 130
    os._exit(rc)  # (no multiprocessing atexit work: the parent supervises)


# ------------------------------------------------------------------------------------------------
# API server process

def _api_server_main(args: argparse.Namespace, sock: socket.socket, index: int, engine_count: int,
                     layout: Layout, report: Connection, commands: Connection) -> None:
    _child_setup(args)
    from .server import prepare_process

    prepare_process()
    try:
        rc = event_loop.run(_api_server_class()(args, sock, index, engine_count, layout, report, commands).run())
    except CLIError as e:
        logger.error("API server %d: %s", index, e)
        rc = 2
    os._exit(rc)


def _api_server_class():
    from ..faults.shared import SharedFaultController
    from ..vllm.metrics_multiproc import SharedMetrics
    from ..wire.client import EngineCoreClient
    from .server import Hosting, _ServeCommand, identity_headers

    class ApiServer(_ServeCommand):
        """serve, with the engine-core client as its engine (the engines' services run there)."""

        def __init__(self, args, sock, index, engine_count, layout, report, commands) -> None:
            headers = [*identity_headers(os.environ), (API_SERVER_HEADER, str(index))]
            super().__init__(args, sock, Hosting(headers=headers, log_ready=False))
            self.index = index
            self.layout = layout
            self.report = report
            self.commands = commands
            self.dp_size = engine_count
            self.shared_metrics: SharedMetrics | None = None

        def load(self) -> None:
            super().load()
            # the fault script, gauges, rates and counts of every API server are one state (the
            # parent's control API serves it): "fail the next 5" fails 5 in all
            mine, seed = self.faults, getattr(self.args, "seed", None)
            self.faults = SharedFaultController(
                self.layout.faults, create=False, rates=mine.rates, model=mine.model, max_model_len=mine.max_model_len,
                seed=seed if seed is None or self.index == 0 else f"{seed}/{self.index}")

        def open_listener(self, stack: contextlib.AsyncExitStack) -> None:
            self.host = self.args.host or "0.0.0.0"
            self.grpc = None
            stack.callback(_close_quietly, self.sock)
            stack.callback(self.faults.close)
            loop = asyncio.get_running_loop()
            loop.add_reader(self.commands.fileno(), self.on_command)
            stack.callback(self.stop_commands)

        def on_command(self) -> None:
            """A message of the parent: {"log": filter} (PUT /log on the control API)."""
            try:
                msg = self.commands.recv()
            except (EOFError, OSError):
                self.stop_commands()
                return
            if "log" in msg:
                from ..logging_setup import apply_log_filter

                apply_log_filter(msg["log"])

        def stop_commands(self) -> None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.commands.fileno())

        def create_engines(self) -> None:
            self.engine = EngineCoreClient(self.engine_args, input_address=self.layout.inputs[self.index],
                                           output_address=self.layout.outputs[self.index],
                                           engine_count=self.dp_size, client_index=self.index,
                                           ready_timeout=STARTUP_TIMEOUT)
            self.engine.bind()

        def attach_kv_events(self, stack: contextlib.AsyncExitStack) -> None:
            pass  # published by the engine-core processes

        def attach_forward_pass_metrics(self, stack: contextlib.AsyncExitStack) -> None:
            pass

        async def start_engines(self, stack: contextlib.AsyncExitStack) -> None:
            stack.callback(self.engine.close)
            await self.engine.start()
            sources = {r: p.get("kv_events_config") for r, p in self.engine.ready_payloads.items()
                       if p.get("kv_events_config")}
            if sources:
                self.extensions.kv_event_sources = sources
            self.engine.on_dead(self.engine_died)

        async def start_control_api(self, stack: contextlib.AsyncExitStack) -> None:
            pass  # the parent serves it

        async def start_pd_services(self, stack: contextlib.AsyncExitStack) -> None:
            pass  # the engine-core processes run them

        async def wait_loading(self) -> bool:
            return True  # the engine-core processes load (their handshake waits for it)

        def build_server(self):
            server = super().build_server()
            app = server.config.app.app  # (TurnSlices around the OpenAI app)
            if getattr(app, "metrics", None) is not None:
                self.shared_metrics = SharedMetrics(app.metrics, self.layout.metrics_dir)
                app.metrics = self.shared_metrics
                self.shared_metrics.start()
            return server

        def log_ready(self, where: str | None = None) -> None:
            super().log_ready(where)
            self.report.send({"api_server": self.index, "pid": os.getpid()})

        def engine_died(self) -> None:
            # vLLM's terminate_if_errored: an API server whose engine is dead shuts down (the
            # responses in flight have their error already; uvicorn lets them finish)
            if self.server is not None:
                self.server.should_exit = True

        async def drain(self) -> None:
            await super().drain()
            if self.shared_metrics is not None:
                self.shared_metrics.close()

    return ApiServer


# ------------------------------------------------------------------------------------------------
# parent

class _Child:
    def __init__(self, kind: str, index: int, proc: multiprocessing.process.BaseProcess) -> None:
        self.kind, self.index, self.proc = kind, index, proc

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index} (pid {self.proc.pid})"


class MultiProcessServe:
    """The parent of `serve --api-server-count N`: one method per phase."""

    def __init__(self, args: argparse.Namespace, defaulted: bool = False) -> None:
        self.args = args
        self.defaulted = defaulted
        self.api_server_count = int(args.api_server_count)
        self.t0 = time.perf_counter()
        self.children: list[_Child] = []
        self.exit_code = 0
        self.stopping = 0  # signals received
        self.failed = False
        self.tmp = ""  # the private directory of the ipc sockets (and the metrics files), once made
        self.control = None
        self.faults = None  # the API servers' shared fault state (served by the control API)
        self.commands: list[Connection] = []  # to each API server
        self.control_sock: socket.socket | None = None  # --control-address, claimed at start-up
        self.lockstep: Any = None  # the DP lockstep coordinator (wire/lockstep.py), with two ranks or more

    # --- start-up ------------------------------------------------------------------------------
    def load(self) -> None:
        """Every CLIError (the same checks as one process) before a socket or a process."""
        from .server import _ServeCommand

        cmd = _ServeCommand(self.args, None)
        cmd.load()
        if getattr(self.args, "grpc", False):
            raise CLIError("--api-server-count: more than one API server serves HTTP only (not --grpc)")
        if self.api_server_count > 1 and cmd.extensions.lora.runtime_updating:  # (vLLM's run_multi_api_server)
            raise CLIError("--api-server-count: VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with "
                           "api_server_count > 1")
        self.settings, self.engine_args, self.engine_count = cmd.settings, cmd.engine_args, cmd.engine_count
        self.check_fpm_ports()
        self.start_fpm_trace(cmd)
        self.initial_faults = cmd.faults
        self.textless_ids = cmd.tokenizer.random_text_avoid(self.engine_args.vocab_size)
        self.ignored = cmd.ignored
        if self.defaulted:  # (once every flag is checked: a CLI error stays one line)
            logger.info("Defaulting api_server_count to data_parallel_size (%d).", self.api_server_count)

    def start_fpm_trace(self, cmd: Any) -> None:
        """--forward-pass-metrics-trace with several engine-core processes: the meta line here,
        then each process appends its ranks' lines (attach_forward_pass_metrics). A gzip file or
        stdout cannot take lines from several processes: a CLI error."""
        path = self.args.forward_pass_metrics_trace
        if path is None or cmd.engine_count == 1:
            return
        if path == "-" or path.lower().endswith(".gz"):
            raise CLIError(f"--forward-pass-metrics-trace: {cmd.engine_count} engine-core processes append to one "
                           "plain file (not gzip, not stdout); give --api-server-count 1 to keep the engines in one "
                           "process")
        from ..fpm.attach import trace_sink

        try:
            trace_sink(path, cmd.settings.model_name)[1].close()
        except OSError as e:
            raise CLIError(f"--forward-pass-metrics-trace: {e}") from None

    def check_fpm_ports(self) -> None:
        """Each engine-core process binds its rank's forward-pass-metrics port (--forward-pass-metrics-port
        + rank); one that is taken is the CLI error one process gives, before any child starts."""
        port = self.args.forward_pass_metrics_port
        if port is None:
            return
        from ..fpm.publisher import rank_endpoint

        ctx = zmq.Context.instance()
        for rank in range(self.engine_count):
            sock = ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(rank_endpoint("0.0.0.0", port, rank))
            except zmq.ZMQError as e:
                raise CLIError(f"--forward-pass-metrics-port: cannot bind {port}: {e}") from None
            finally:
                sock.close(linger=0)

    def open_listener(self) -> socket.socket:
        """One listening socket on --port, inherited by every API server (vLLM's way): the process
        that is free first takes the next connection."""
        host = self.host = self.args.host or "0.0.0.0"
        try:
            sock = bind_listener(host, self.args.port, f"{host}:{self.args.port}")
        except socket.gaierror as e:
            raise CLIError(f"--host: cannot resolve {host!r}: {e.strerror or e}") from None
        except OSError as e:
            raise CLIError(f"--host/--port: {e.strerror or e}") from None
        self.port = sock.getsockname()[1]
        sock.listen(2048)
        return sock

    def claim_control_address(self) -> None:
        """--control-address is claimed before any child starts: a clash is a CLI error at once,
        and a control call made once an API server answers waits in the backlog until the
        control API serves (never refused), as with one process, whose control API is up before
        its port."""
        self.control_sock = None
        if not self.args.control_address:
            return
        from ..control.server import listen_control

        try:
            self.control_sock = listen_control(self.args.control_address)
        except (OSError, ValueError) as e:
            raise CLIError(f"--control-address: {e}") from None

    def layout(self) -> Layout:
        self.tmp = tempfile.mkdtemp(prefix="vllm-vcr-")
        metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if metrics_dir:
            logger.warning("Found PROMETHEUS_MULTIPROC_DIR was set by user. This directory must be wiped between "
                           "runs or you will find inaccurate metrics.")
            os.makedirs(metrics_dir, exist_ok=True)
        else:
            metrics_dir = os.path.join(self.tmp, "prometheus")
            os.makedirs(metrics_dir)
        ipc = f"ipc://{self.tmp}"
        n = self.api_server_count
        layout = Layout(handshake=f"{ipc}/handshake", inputs=[f"{ipc}/in{i}" for i in range(n)],
                        outputs=[f"{ipc}/out{i}" for i in range(n)], metrics_dir=metrics_dir,
                        faults=os.path.join(self.tmp, "faults"),
                        lockstep=f"{ipc}/lockstep" if self.engine_count > 1 else None)
        from ..faults.shared import SharedFaultController

        f = self.initial_faults
        self.faults = SharedFaultController(layout.faults, create=True, rates=f.rates, model=f.model,
                                            max_model_len=f.max_model_len)
        return layout

    def start_children(self, sock: socket.socket, layout: Layout) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.reports, sender = ctx.Pipe(duplex=False)
        child_args = argparse.Namespace(**{k: v for k, v in vars(self.args).items() if not k.startswith("_")})
        for rank in range(self.engine_count):
            eargs = copy.deepcopy(self.engine_args)
            control = "127.0.0.1:0" if self.args.control_address else None
            p = ctx.Process(target=_engine_core_main, name=f"EngineCore_DP{rank}", daemon=False,
                            args=(child_args, eargs, rank, self.engine_count, layout.handshake, self.textless_ids,
                                  control, self.settings.model_name, sender, layout.lockstep))
            p.start()
            self.children.append(_Child("engine core", rank, p))
        for i in range(self.api_server_count):
            commands, to_child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_api_server_main, name=f"ApiServer_{i}", daemon=False,
                            args=(child_args, sock, i, self.engine_count, layout, sender, commands))
            p.start()
            commands.close()
            self.commands.append(to_child)
            self.children.append(_Child("API server", i, p))
        sock.close()  # each API server has its own copy
        sender.close()

    async def handshake(self, layout: Layout) -> None:
        """The frontend side of the engines' start-up handshake (wire/handshake.py is the other)."""
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(layout.handshake)
        init = enc.encode({"addresses": {"inputs": layout.inputs, "outputs": layout.outputs,
                                         "coordinator_input": None, "coordinator_output": None,
                                         "frontend_stats_publish_address": None},
                           "parallel_config": {}})
        pending = {r.to_bytes(2, "little") for r in range(self.engine_count)}
        ready: set[bytes] = set()
        try:
            while len(ready) < self.engine_count:
                ident, msg = await sock.recv_multipart()
                status = dec.decode(msg).get("status")
                if status == "HELLO" and ident in pending:
                    pending.discard(ident)
                    await sock.send_multipart([ident, init])
                elif status == "READY":
                    ready.add(ident)
        finally:
            sock.close(linger=0)

    async def wait_started(self) -> None:
        """Every engine core serving and every API server listening (else a child died: exit 1)."""
        want = self.engine_count + self.api_server_count
        self.control_urls: dict[int, str] = {}
        loop = asyncio.get_running_loop()
        got = 0
        while got < want:
            if self.dead_child() is not None:
                raise _Failed(f"{self.dead_child().name} exited during start-up")
            if not await loop.run_in_executor(None, self.reports.poll, 0.2):
                continue
            msg = self.reports.recv()
            got += 1
            if "rank" in msg and msg.get("control"):
                self.control_urls[msg["rank"]] = msg["control"]

    async def start_control(self) -> None:
        if not self.args.control_address:
            return
        from ..control.fanout import start_control_fanout

        urls = [self.control_urls[r] for r in range(self.engine_count)]
        try:
            self.control = await start_control_fanout(self.args.control_address, urls,
                                                      getattr(self.args, "control_token", None),
                                                      faults=self.faults, on_log=self.apply_log_filter,
                                                      sock=self.control_sock)
            self.control_sock = None
        except (OSError, ValueError, RuntimeError) as e:
            raise CLIError(f"--control-address: {e}") from None

    def apply_log_filter(self, spec: str) -> None:
        """PUT /log, accepted by the engine cores: the same filter here and in every API server."""
        from ..logging_setup import apply_log_filter, reloadable_logging_installed

        if reloadable_logging_installed():
            apply_log_filter(spec)
        for conn in self.commands:
            with contextlib.suppress(OSError, ValueError):
                conn.send({"log": spec})

    # --- supervision ---------------------------------------------------------------------------
    def dead_child(self) -> _Child | None:
        for c in self.children:
            if c.proc.exitcode is not None:
                return c
        return None

    def signal_children(self, sig: int = signal.SIGTERM, kinds: tuple[str, ...] = ("engine core", "API server")) -> None:
        for c in self.children:
            if c.kind in kinds and c.proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        self.stopping += 1
        if self.stopping == 1:
            logger.info("received %s: shutting down %d API server(s) and %d engine core(s)", sig.name,
                        self.api_server_count, self.engine_count)
        else:
            logger.info("received %s again: aborting all requests now", sig.name)
        self.signal_children()
        self.wake.set()

    async def supervise(self) -> None:
        loop = asyncio.get_running_loop()
        for c in self.children:
            loop.add_reader(c.proc.sentinel, self.wake.set)
        while True:
            await self.wake.wait()
            self.wake.clear()
            alive = [c for c in self.children if c.proc.exitcode is None]
            if self.lockstep is not None:  # a rank gone does not hold the others' steps
                for c in self.children:
                    if c.kind == "engine core" and c.proc.exitcode is not None:
                        await self.lockstep.gone(c.index)
            if not alive:
                return
            if self.stopping or self.failed:
                continue
            dead = self.dead_child()
            if dead is None:
                continue
            self.failed = True
            self.exit_code = 1
            logger.error("%s died with exit code %s", dead.name, dead.proc.exitcode)
            # vLLM's run_multi_api_server: any process gone takes the others down (SIGTERM, then SIGKILL).
            # An engine core that could say so has told the API servers (ENGINE_CORE_DEAD: their
            # requests fail with EngineDeadError); one killed outright leaves them to be stopped
            self.signal_children()
            timeout = float(self.engine_args.shutdown_timeout) + EXIT_GRACE
            loop.call_later(timeout, self.signal_children, signal.SIGKILL)

    # --- the whole run -------------------------------------------------------------------------
    async def run(self) -> int:
        self.load()
        sock = self.open_listener()
        try:
            self.claim_control_address()
        except CLIError:
            _close_quietly(sock)
            raise
        loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        try:
            layout = self.layout()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.on_signal, sig)
            self.start_lockstep(layout)
            self.start_children(sock, layout)
            try:
                await self.start_up(layout)
            except _Failed as e:
                logger.error("%s", e)
                self.exit_code = 1
                self.failed = True
                self.signal_children()
            await self.supervise()
        finally:
            _close_quietly(sock)
            if self.lockstep is not None:
                self.lockstep_task.cancel()
                with contextlib.suppress(BaseException):
                    await self.lockstep_task
                self.lockstep.close()
            if self.control_sock is not None:
                _close_quietly(self.control_sock)
            for c in self.children:
                if c.proc.exitcode is None:
                    c.proc.kill()
                c.proc.join(1)
                with contextlib.suppress(Exception):
                    loop.remove_reader(c.proc.sentinel)
            if self.control is not None:
                await self.control.stop()
                await self.control.app.state.client.aclose()
            for conn in self.commands:
                conn.close()
            if self.faults is not None:
                self.faults.close()
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        if not self.failed:
            for c in self.children:
                if c.proc.exitcode not in (0, None):
                    logger.warning("%s exited with code %s", c.name, c.proc.exitcode)
        return self.exit_code

    def start_lockstep(self, layout: Layout) -> None:
        """vLLM's DP coordinator for the ranks' lockstep: the engine cores of an MoE model connect
        to it (a dense model's do not, and step on their own)."""
        if layout.lockstep is None:
            return
        from ..engine.policy import LockstepRule, policy_for
        from ..wire.lockstep import LockstepCoordinator

        # the engine type's rule (vLLM's waves, SGLang's per-step gather); its ranks decide whether to join
        rule = policy_for(self.engine_args.engine_type).dp_lockstep or LockstepRule()
        self.lockstep = LockstepCoordinator(zmq.asyncio.Context.instance(), layout.lockstep, rule)
        self.lockstep_task = asyncio.get_running_loop().create_task(self.lockstep.run(), name="lockstep")

    async def start_up(self, layout: Layout) -> None:
        """The handshake and every child's "ready" (or a signal first)."""
        started = asyncio.ensure_future(asyncio.gather(self.handshake(layout), self.wait_started()))
        stop = asyncio.ensure_future(self.wake.wait())
        done, _ = await asyncio.wait({started, stop}, timeout=STARTUP_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        if started not in done:
            started.cancel()
            with contextlib.suppress(BaseException):
                await started
            if not self.stopping:
                raise _Failed(f"not started after {STARTUP_TIMEOUT:g} s")
            return
        stop.cancel()
        started.result()
        await self.start_control()
        self.log_ready()

    def log_ready(self) -> None:
        if self.ignored:
            logger.info("ignoring vLLM flags that mean nothing here: %s", " ".join(self.ignored))
        s = self.settings
        def pids(kind: str) -> str:
            return " ".join(str(c.proc.pid) for c in self.children if c.kind == kind)

        logger.info("vllm-vcr serve: model %s, %d API server(s) (pids %s), %d engine core process(es) (pids %s), "
                    "max_model_len %d, listening on http://%s:%d (ready in %.0f ms)", ", ".join(s.served_model_names),
                    self.api_server_count, pids("API server"), self.engine_count, pids("engine core"),
                    s.max_model_len, self.host, self.port, (time.perf_counter() - self.t0) * 1000)


class _Failed(Exception):
    pass


def run_api_servers(args: argparse.Namespace, defaulted: bool = False) -> int:
    """`defaulted`: the count is vLLM's default (the data-parallel size), not given."""
    from ..gc_tuning import tune_for_serving

    tune_for_serving()
    return event_loop.run(MultiProcessServe(args, defaulted).run())
