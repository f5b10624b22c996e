"""Start-up and shutdown of `vllm-vcr serve`: one method per phase, unwound by an exit stack.

`serve(args)` is the coroutine (usable from Python); `run_server(args)` runs it in the CLI's event
loop. Start-up: load (flags, tokenizer), listener (claim the port), engines, KV events, control
API, P/D services; then serve until a signal. SIGTERM/SIGINT: stop accepting connections, drain
the engines with --shutdown-timeout semantics (drain, then abort), let open streams finish, exit 0;
a second signal aborts what is still in flight and exits.
Whatever started is stopped in reverse order, also when a later phase fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import uvicorn  # noqa: E402

from .. import event_loop  # noqa: E402
from ..control.server import start_control_server  # noqa: E402
from ..engine.async_engine import AsyncEngine  # noqa: E402
from ..engine.block_hash import ContentHasher  # noqa: E402
from ..engine.config import ConfigError  # noqa: E402
from ..faults import FaultController, FaultSpecError  # noqa: E402
from ..faults.cli_args import rates_from_args  # noqa: E402
from ..fd_limits import prepare_for_many_connections  # noqa: E402
from ..frontend.planned_output import planned_token_source  # noqa: E402
from ..gc_tuning import collect_while_idle, tune_for_serving  # noqa: E402
from ..heap_trim import start_idle_trimming  # noqa: E402
from ..http.acceptor import BurstAcceptor, TurnSlices  # noqa: E402
from ..http.faults_adapter import FaultGate, install_gauges  # noqa: E402
from ..http.serving_base import ServeSettings  # noqa: E402
from ..http.uvicorn_internals import protocol_factory  # noqa: E402
from ..kv_events import KVEventsConfigError, kv_events_config_from_cli  # noqa: E402
from ..kv_events.attach import attach_kv_events  # noqa: E402
from ..listen_socket import bind_listener  # noqa: E402
from ..pd import start_pd_services  # noqa: E402
from ..replay.inputs import engine_inputs  # noqa: E402
from .app import build_app  # noqa: E402
from .loading import simulate_loading  # noqa: E402
from .settings import CLIError, build_settings_and_args  # noqa: E402
from .warmup import warm_up  # noqa: E402
from ..server_ticks import EventServer  # noqa: E402

logger = logging.getLogger("vllm_vcr.serve")

BACKLOG = 2048


# After a second signal, how long aborted streams get to send their last event before uvicorn
# stops waiting for connections.
FORCE_EXIT_GRACE = 1.0


class _Server(EventServer):
    """uvicorn, with our own signal handling: the first signal starts the engine shutdown
    (drain up to --shutdown-timeout, then abort) next to uvicorn's; a second one (SIGTERM or
    SIGINT) aborts every request in flight and stops waiting for connections, as `play` does.
    No signal is re-raised, so the process exits 0. Without `own_signals` (many servers in one
    process: a fleet) the process's owner calls `handle_exit` instead."""

    def __init__(self, config: uvicorn.Config, on_exit: Any, on_ready: Any = None, on_force_exit: Any = None,
                 own_signals: bool = True):
        super().__init__(config)
        self._own_signals = own_signals
        self._on_exit = on_exit
        self._on_ready = on_ready
        self._on_force_exit = on_force_exit
        self._exit_started = False
        self._force_started = False

    @contextlib.contextmanager
    def capture_signals(self):
        if not self._own_signals:
            yield
            return
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        installed = []
        for sig in sigs:
            try:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # no uvloop server on the sockets: it would accept one connection per turn of the loop
        await super().startup(sockets=[])
        if self.started and sockets:
            factory = protocol_factory(self)
            self.servers = [BurstAcceptor(sock, factory, ssl=self.config.ssl) for sock in sockets]
        if self.started and self._on_ready is not None:
            self._on_ready()  # "ready" only once connections are taken

    def handle_exit(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name if sig else "exit"
        if not self._exit_started:
            self._exit_started = True
            # (a fleet's host says it once for all its workers)
            logger.log(logging.INFO if self._own_signals else logging.DEBUG, "received %s: shutting down", name)
            self._on_exit()
        elif not self._force_started:
            self._force_started = True
            logger.log(logging.INFO if self._own_signals else logging.DEBUG,
                       "received %s again: aborting all requests now", name)
            if self._on_force_exit is not None:
                self._on_force_exit()
            # the aborted streams end on their own; a connection that does not is not waited for long
            asyncio.get_running_loop().call_later(FORCE_EXIT_GRACE, setattr, self, "force_exit", True)
        super().handle_exit(sig, frame)


@dataclass
class Hosting:
    """How a server is hosted: alone in its process (serve), or one of many workers in one event
    loop (fleet), which share tokenizers and leave signals to the process's owner."""

    own_signals: bool = True
    # (tokenizer source, chat template, renderer threads) -> Tokenizer, shared by the servers of a process
    tokenizers: dict | None = None
    # extra response headers (name, value): the pod's and worker's identity
    headers: list[tuple[str, str]] = field(default_factory=list)
    log_ready: bool = True
    # tokenizers warmed up already (ids): first-use work is the process's, done once per tokenizer
    warmed: set | None = None


def identity_headers(env: Any, worker: str | None = None) -> list[tuple[str, str]]:
    """The headers naming who answered: POD_NAME / POD_NAMESPACE as llm-d-inference-sim sets
    them (x-inference-pod, x-inference-namespace), and a fleet's worker name."""
    out = []
    if env.get("POD_NAME"):
        out.append(("x-inference-pod", env["POD_NAME"]))
    if env.get("POD_NAMESPACE"):
        out.append(("x-inference-namespace", env["POD_NAMESPACE"]))
    if worker is not None:
        out.append(("x-inference-worker", worker))
    return out


class _ServeCommand:
    """One run of `vllm-vcr serve`; the phases in the order `run` calls them."""

    def __init__(self, args: argparse.Namespace, sock: socket.socket | None, hosting: Hosting | None = None) -> None:
        self.args = args
        self.sock = sock
        self.hosting = hosting if hosting is not None else Hosting(headers=identity_headers(os.environ))
        self.t0 = time.perf_counter()
        self.exit_code = 0
        self.server: _Server | None = None
        self.control: Any = None  # the control API's server, when it runs
        self.ready = asyncio.Event()  # set once the port takes connections

    async def run(self) -> int:
        self.load()
        async with contextlib.AsyncExitStack() as stack:
            self.open_listener(stack)
            self.create_engines()
            self.attach_kv_events(stack)
            self.attach_forward_pass_metrics(stack)
            await self.start_engines(stack)
            await self.start_control_api(stack)
            await self.start_pd_services(stack)
            if not await self.wait_loading():
                return self.exit_code
            await self.warm_up()
            if self.grpc is not None:
                try:
                    await self.serve_grpc_until_signal()
                finally:
                    await self.drain()
                return self.exit_code
            server = self.server = self.build_server()
            try:
                await self.serve_until_signal(server)
            finally:
                await self.drain()
        return self.exit_code

    def load(self) -> None:
        """Flags, tokenizer, chat template, engine arguments: every CLIError before any socket."""
        (self.settings, self.engine_args, self.tokenizer, self.engine_count,
         self.ignored) = build_settings_and_args(self.args, tokenizers=self.hosting.tokenizers)
        self.kv_config = _kv_events_config(self.args)
        self.tls = _tls_options(self.args)
        self.faults = _fault_controller(self.args, self.settings)
        from .extensions import ServeExtensions  # LoRA, sleep, operator routes, pooling

        try:
            self.extensions = ServeExtensions.from_cli(self.args)
            self.extensions.load_static_adapters(self.settings.served_model_names)  # a bad --lora-modules stops here
        except ValueError as e:
            raise CLIError(str(e)) from None
        self.extensions.engine_args = self.engine_args
        self.extensions.configure_engine(self.engine_args)

    def open_listener(self, stack: contextlib.AsyncExitStack) -> None:
        """Claim the port at once, so a clash is reported before anything starts."""
        self.host = self.args.host or "0.0.0.0"
        self.grpc = None
        if getattr(self.args, "grpc", False):  # vLLM: the gRPC server on --port instead of HTTP
            from ..grpc.server import GrpcServer

            try:
                self.grpc = GrpcServer(self.host, self.args.port)
            except OSError as e:
                raise CLIError(f"--host/--port: {e}") from None
            stack.push_async_callback(self.grpc.stop, 0)
            return
        if self.sock is None:
            try:
                self.sock = bind_listener(self.host, self.args.port, f"{self.host}:{self.args.port}")
            except socket.gaierror as e:
                raise CLIError(f"--host: cannot resolve {self.host!r}: {e.strerror or e}") from None
            except OSError as e:
                raise CLIError(f"--host/--port: {e.strerror or e}") from None
        stack.callback(_close_quietly, self.sock)

    def create_engines(self) -> None:
        try:
            inputs = engine_inputs(self.engine_args)
            if self.kv_config is None:  # no block hash leaves the process: any content hash finds the same prefixes
                inputs["block_hasher"] = ContentHasher()
            self.engine = AsyncEngine(self.engine_args, engine_count=self.engine_count,
                                      token_source_factory=planned_token_source(self.engine_args.vocab_size),
                                      textless_ids=self.tokenizer.random_text_avoid(self.engine_args.vocab_size),
                                      on_idle=collect_while_idle, **inputs)
        except ConfigError as e:  # a bad trace or replay table: name the flag, no traceback
            raise CLIError(str(e)) from None

    def attach_kv_events(self, stack: contextlib.AsyncExitStack) -> None:
        if self.kv_config is None:
            return
        try:
            publishers = attach_kv_events(self.engine.engines, self.kv_config)
        except OSError as e:  # the publisher's endpoint cannot be bound
            raise CLIError(f"--kv-events-config: {e}") from None
        self.kv_publishers = publishers
        for pub in publishers:
            stack.callback(pub.close)
        self.extensions.kv_event_sources = {  # what each engine tells vLLM's frontend in its handshake
            rank: pub.publisher_config.to_dict() for rank, pub in enumerate(publishers)
            if pub.publisher_config is not None}

    def attach_forward_pass_metrics(self, stack: contextlib.AsyncExitStack) -> None:
        attach_forward_pass_metrics(self.engine.engines, self.args, self.settings.model_name, self.engine_args, stack)

    async def start_engines(self, stack: contextlib.AsyncExitStack) -> None:
        await self.engine.start()
        start_idle_trimming(stack, lambda: self.engine.engines)
        # at start-up there is nothing to drain; after serving, drain() has stopped them already
        stack.push_async_callback(self.engine.stop, 0)

    async def start_control_api(self, stack: contextlib.AsyncExitStack) -> None:
        if not self.args.control_address:
            return
        try:
            control = await start_control_server(self.engine, self.args.control_address, faults=self.faults,
                                                 token=getattr(self.args, "control_token", None))
        except (OSError, ValueError, RuntimeError) as e:  # bad address, port taken, server failed
            raise CLIError(f"--control-address: {e}") from None
        stack.push_async_callback(control.stop)
        self.control = control
        from ..control.loras import add_lora_route

        add_lora_route(control.app, self.extensions.lora_report)

    async def start_pd_services(self, stack: contextlib.AsyncExitStack) -> None:
        try:
            pd = await start_pd_services(self.engine.engines, self.args)
        except OSError as e:
            raise CLIError(str(e)) from None
        stack.push_async_callback(pd.stop)

    def build_server(self) -> _Server:
        self.sock.listen(BACKLOG)
        app = build_app(self.engine, self.tokenizer, self.settings, faults=FaultGate(self.faults),
                        extensions=self.extensions)
        install_gauges(app.metrics, self.faults)
        config = uvicorn.Config(
            TurnSlices(app),
            lifespan="off",
            http="httptools" if importlib.util.find_spec("httptools") is not None else "h11",
            loop="none",
            log_config=None,
            # None leaves uvicorn's loggers to VLLM_VCR_LOG / RUST_LOG (target `uvicorn`)
            log_level=self.args.uvicorn_log_level,
            access_log=bool(self.args.enable_access_log),
            server_header=True,  # "server: uvicorn", as vLLM's responses carry
            date_header=True,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=max(float(self.engine_args.shutdown_timeout), 0.0) + 5.0,
            backlog=BACKLOG,
            proxy_headers=False,  # no X-Forwarded-* rewriting: one middleware less per request
            **self.tls,  # --ssl-*: HTTPS, as vLLM hands them to uvicorn
            headers=list(self.hosting.headers),
        )
        self.stopping: list[asyncio.Task] = []
        return _Server(config, self.begin_drain, self.log_ready, self.abort_drain, own_signals=self.hosting.own_signals)

    def begin_drain(self) -> None:
        # the first signal: drain/abort the engines while uvicorn stops accepting and waits for open streams
        self.stopping.append(asyncio.ensure_future(self.engine.stop()))

    def abort_drain(self) -> None:
        # a second signal: the drain ends now, every request in flight is aborted
        self.stopping.append(asyncio.ensure_future(self.engine.stop(0.0)))

    async def wait_loading(self) -> bool:
        """Simulated model loading (--startup-time): like vLLM, nothing listens on the port until
        it is over; False when the process must end instead (a loading failure: exit 1; a signal: 0)."""
        if not (self.engine_args.startup_time > 0 or self.engine_args.startup_failure):
            return True
        stopped = await simulate_loading(self.engine, self.engine_args.startup_time, self.hosting.own_signals)
        if stopped is None:
            return True
        self.exit_code = stopped
        return False

    async def warm_up(self) -> None:
        """First-use work done before the port listens (warmup.py): nothing of it is counted."""
        warmed = self.hosting.warmed
        if warmed is not None:
            if id(self.tokenizer) in warmed:
                return
            warmed.add(id(self.tokenizer))
        took = await warm_up(self.engine_args, self.tokenizer, self.settings)
        logger.info("warmed up in %.0f ms", took * 1000)
        if self.settings.trust_request_chat_template:  # request templates render in worker processes
            from ..frontend.chat_template import POOL as TEMPLATE_POOL

            TEMPLATE_POOL.warm()

    async def serve_until_signal(self, server: _Server) -> None:
        await server.serve(sockets=[self.sock])

    async def serve_grpc_until_signal(self) -> None:
        """`--grpc`: the VllmEngine service on --port until SIGINT/SIGTERM; then the engine drains
        (as after HTTP's first signal) while the server lets open calls finish."""
        from ..grpc.servicer import VllmEngineService

        self.stopping = []
        publishers = getattr(self, "kv_publishers", [])
        service = VllmEngineService(
            self.engine, self.tokenizer, self.settings,
            model_path=self.args.model_opt or self.args.model_tag or self.settings.model_name,
            max_num_seqs=self.engine_args.config.max_num_seqs,
            kv_endpoints=[(p.data_parallel_rank, p.endpoint) for p in publishers if getattr(p, "endpoint", None)],
            kv_topic=self.kv_config.topic if self.kv_config is not None else "", pooling=self.extensions.pooling)
        self.grpc.add(service, self.engine)
        await self.grpc.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                logger.info("received %s again: aborting all requests now", sig.name)
                self.abort_drain()
                return
            logger.info("received %s: shutting down", sig.name)
            self.grpc.health.shutting_down = True
            stop.set()
            self.begin_drain()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            self.log_ready(f"grpc://{self.host}:{self.grpc.port}")
            await stop.wait()
            await self.grpc.stop(max(float(self.engine_args.shutdown_timeout), 0.0) + 5.0)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def log_ready(self, where: str | None = None) -> None:
        self.ready.set()
        if not self.hosting.log_ready:
            return
        if self.ignored:
            logger.info("ignoring vLLM flags that mean nothing here: %s", " ".join(self.ignored))
        s, tok = self.settings, self.tokenizer
        logger.info("vllm-vcr serve: model %s, tokenizer %s (vocab %d), %d engine(s), max_model_len %d, "
                    "listening on %s (ready in %.0f ms)",
                    ", ".join(s.served_model_names), tok.source, tok.vocab_size, self.engine_count,
                    s.max_model_len,
                    where or f"{'https' if self.tls else 'http'}://{self.host}:{self.sock.getsockname()[1]}",
                    (time.perf_counter() - self.t0) * 1000)

    async def drain(self) -> None:
        """Finish the engines' shutdown: the drain a signal started, or one with the default timeout."""
        if self.stopping:
            await asyncio.gather(*self.stopping, return_exceptions=True)
        await self.engine.stop()


async def serve(args: argparse.Namespace, *, sock: socket.socket | None = None) -> int:
    """Run `vllm-vcr serve` in the current event loop until a signal (or `should_exit`)."""
    return await _ServeCommand(args, sock).run()


ServeCommand = _ServeCommand  # one server of a fleet (fleet/host.py) is one serve command, hosted


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def attach_forward_pass_metrics(cores: list[Any], args: argparse.Namespace, model_name: str, engine_args: Any,
                                stack: contextlib.AsyncExitStack, shared_trace: bool = False) -> None:
    """--forward-pass-metrics-port / --forward-pass-metrics-trace on `cores` (where the engines run:
    this process, or each engine-core process of `--api-server-count`): rank r publishes on the
    port + r; `shared_trace`: the trace is one of several processes, its meta line written already
    (each appends its lines). CLIError naming the flag when a port or the file cannot be had."""
    port, path = args.forward_pass_metrics_port, args.forward_pass_metrics_trace
    if port is None and path is None:
        return
    from ..fpm.attach import appending_trace_sink, attach_fpm, trace_sink

    sink = None
    if path is not None:
        try:
            if shared_trace:
                sink, close = appending_trace_sink(path)
                stack.callback(close)
            else:
                sink, writer = trace_sink(path, model_name)
                stack.callback(writer.close)
        except OSError as e:
            raise CLIError(f"--forward-pass-metrics-trace: {e}") from None
    try:
        publishers = attach_fpm(cores, port, host="0.0.0.0", worker_id=engine_args.engine_id,
                                engine_type=engine_args.engine_type, extra_sink=sink)
    except Exception as e:  # zmq.ZMQError: a rank's port is taken
        raise CLIError(f"--forward-pass-metrics-port: cannot bind {port}: {e}") from None
    loop = asyncio.get_running_loop()
    for pub in publishers:
        stack.callback(pub.close)
        stack.callback(loop.create_task(pub.heartbeat(pub.idle), name="fpm-heartbeat").cancel)


def _fault_controller(args: argparse.Namespace, settings: ServeSettings) -> FaultController:
    try:
        rates = rates_from_args(args)
    except FaultSpecError as e:
        raise CLIError(str(e)) from None
    return FaultController(rates, model=settings.model_name, max_model_len=settings.max_model_len,
                           seed=getattr(args, "seed", None))


def _tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """--ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-cert-reqs/--ssl-ciphers as uvicorn.Config
    options (vLLM passes them to uvicorn the same way); {} without a key or certificate. The
    context is built once here, so a missing file or a bad cipher list is a CLI error before the
    port opens."""
    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if not keyfile and not certfile:
        return {}
    if not certfile:
        raise CLIError("--ssl-certfile: required with --ssl-keyfile")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise CLIError(f"--ssl-cert-reqs: must be 0 (none), 1 (optional) or 2 (required), got {args.ssl_cert_reqs}")
    import ssl

    from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context

    options = {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": args.ssl_ca_certs,
               "ssl_cert_reqs": args.ssl_cert_reqs, "ssl_ciphers": args.ssl_ciphers}
    try:
        create_ssl_context(certfile, keyfile, None, SSL_PROTOCOL_VERSION, args.ssl_cert_reqs, args.ssl_ca_certs,
                           args.ssl_ciphers)
    except (OSError, ssl.SSLError, ValueError) as e:
        flag = "--ssl-ciphers" if "cipher" in str(e).lower() else (
            "--ssl-ca-certs" if args.ssl_ca_certs and isinstance(e, OSError) and e.filename == args.ssl_ca_certs
            else "--ssl-keyfile/--ssl-certfile")
        raise CLIError(f"{flag}: {getattr(e, 'strerror', None) or e}") from None
    return options


def _kv_events_config(args: argparse.Namespace) -> Any:
    """--kv-events-config / --enable-kv-cache-events, or None when KV events are off."""
    if args.kv_events_config is None and not args.enable_kv_cache_events:
        return None
    try:
        return kv_events_config_from_cli(args)
    except KVEventsConfigError as e:
        raise CLIError(str(e)) from None


# The tokenizer's worker thread needs the GIL back after each batch; while the loop is busy (a
# burst being read) it waits for the interpreter's switch interval, 5 ms by default, for every
# hand-back. 1 ms keeps a burst's prompts flowing through the worker.
SWITCH_INTERVAL_S = 0.001


def prepare_process() -> None:
    """What a serving process sets once, for all the servers it will host: open-file limit,
    garbage collector, the interpreter's switch interval."""
    prepare_for_many_connections()
    tune_for_serving()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def run_server(args: argparse.Namespace) -> int:
    prepare_process()
    return event_loop.run(serve(args))
