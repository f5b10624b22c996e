"""Start-up and shutdown of `vllm-vcr serve`: tokenizer, engine, uvicorn, signals.

`serve(args)` is the coroutine (usable from Python); `run_server(args)` wraps it in a uvloop
event loop for the CLI. SIGTERM/SIGINT: stop accepting connections, shut the engines down with
--shutdown-timeout semantics (drain, then abort), let open streams finish, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import uvicorn  # noqa: E402

from ..engine_cli import engine_args_from_cli  # noqa: E402
from ..engine.config import ConfigError, EngineArgs  # noqa: E402
from ..gc_tuning import tune_for_serving  # noqa: E402
from .acceptor import BurstAcceptor  # noqa: E402
from .app import OpenAIApp, build_app  # noqa: E402
from .cli import env_api_key, ignored_flags  # noqa: E402
from .serving_base import VLLM_API_VERSION, ServeSettings  # noqa: E402
from .tokenizer import DEFAULT_MODEL_NAME, Tokenizer, TokenizerError, load_tokenizer  # noqa: E402

logger = logging.getLogger("vllm_vcr.serve")


class CLIError(Exception):
    """A bad flag value: printed as `vllm-vcr serve: error: ...`, exit status 2."""


def _hf_cache_dir(repo_id: str) -> Path | None:
    """A tokenizer already in the local Hugging Face cache (read only, never fetched)."""
    if "/" not in repo_id or repo_id.startswith((".", "/")):
        return None
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    snaps = Path(home) / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    try:
        for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            if (snap / "tokenizer.json").is_file():
                return snap
    except OSError:
        return None
    return None


def resolve_tokenizer(model: str | None, tokenizer: str | None) -> Tokenizer:
    """--tokenizer, else MODEL when it holds tokenizer files, else the embedded tokenizer."""
    for value, flag in ((tokenizer, "--tokenizer"), (model, "MODEL")):
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_dir() or path.is_file():
            if (path / "tokenizer.json").is_file() or path.name == "tokenizer.json":
                try:
                    return load_tokenizer(path)
                except TokenizerError as e:
                    raise CLIError(f"{flag}: {e}") from None
            if flag == "--tokenizer":
                raise CLIError(f"--tokenizer: no tokenizer.json in {value!r}")
            continue  # a model directory without tokenizer files: fall through
        if flag == "--tokenizer" and (value.startswith((".", "/", "~")) or os.sep in value and "/" not in value):
            raise CLIError(f"--tokenizer: {value!r} does not exist")
        cached = _hf_cache_dir(value)
        if cached is not None:
            try:
                return load_tokenizer(cached)
            except TokenizerError as e:
                raise CLIError(f"{flag}: {e}") from None
        if flag == "--tokenizer":
            logger.warning("--tokenizer %s is not a local directory and not in the HF cache; vllm-vcr never "
                           "downloads, using the embedded tokenizer", value)
    return load_tokenizer(None)


def _chat_template_source(value: str | None) -> str | None:
    if not value:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as e:
        raise CLIError(f"--chat-template: cannot read {value!r}: {e}") from None
    if any(c in value for c in "{}") and "\n" not in value[:0]:
        return value  # an inline template, as vLLM accepts
    logger.warning("--chat-template %s not found; using the tokenizer's template", value)
    return None


def _ordinary_vocab_size(tok: Tokenizer) -> int:
    """Random tokens are drawn below the first special token when the specials sit at the end
    (the embedded tokenizer says exactly which ids are whole characters)."""
    if tok.random_vocab_size:
        return tok.random_vocab_size
    specials = sorted(tok.special_ids)
    if specials and specials[0] > 0 and specials == list(range(specials[0], specials[0] + len(specials))) \
            and specials[-1] == tok.vocab_size - 1:
        return specials[0]
    return tok.vocab_size


def build_settings_and_args(args: argparse.Namespace) -> tuple[ServeSettings, EngineArgs, Tokenizer, int, list[str]]:
    """Validate everything the command line says; CLIError names the flag."""
    model = args.model_opt or args.model_tag
    if args.model_opt and args.model_tag and args.model_opt != args.model_tag:
        raise CLIError(f"MODEL {args.model_tag!r} and --model {args.model_opt!r} disagree")
    names = args.served_model_name or [model or DEFAULT_MODEL_NAME]
    if any(not n for n in names):
        raise CLIError("--served-model-name: names must not be empty")
    max_model_len = args.max_model_len
    if max_model_len < 1:
        raise CLIError(f"--max-model-len must be >= 1, got {max_model_len}")
    tok = resolve_tokenizer(model, args.tokenizer)
    template = _chat_template_source(args.chat_template)
    if template is not None:
        from .chat_template import ChatTemplate, ChatTemplateError

        try:
            tok.chat_template = ChatTemplate(template)
        except ChatTemplateError as e:
            raise CLIError(f"--chat-template: {e}") from None
    engine_count = args.engine_count
    if args.data_parallel_size is not None and engine_count == 1:
        engine_count = args.data_parallel_size
    if engine_count < 1:
        raise CLIError(f"--engine-count must be >= 1, got {engine_count}")
    if getattr(args, "ignored__disable_log_requests", False):
        args.log_requests = False
    eos = tok.eos_token_id
    try:
        engine_args = engine_args_from_cli(
            args,
            advertised_max_model_len=max_model_len,
            model_name=names[0],
            vocab_size=_ordinary_vocab_size(tok),
            eos_token_id=eos,
        )
    except ConfigError as e:
        raise CLIError(str(e)) from None
    except (TypeError, ValueError) as e:  # e.g. a MOCK_* environment variable that is not a number
        raise CLIError(str(e)) from None
    # vLLM flags the engine honours, when the engine's own parser did not take them already
    if getattr(args, "enable_prefix_caching", None) is not None:
        engine_args.enable_prefix_caching = bool(args.enable_prefix_caching)
    if getattr(args, "enable_chunked_prefill", None) is not None:
        engine_args.enable_chunked_prefill = bool(args.enable_chunked_prefill)
    if getattr(args, "prefix_caching_hash_algo", None) is not None:
        engine_args.prefix_caching_hash_algo = args.prefix_caching_hash_algo
    try:
        engine_args.validate()
    except ConfigError as e:
        raise CLIError(str(e)) from None
    reasoning_parser = getattr(args, "reasoning_parser", None) or None
    reasoning_ids = None
    if reasoning_parser and engine_args.reasoning:
        from ..engine.tokens import ReasoningConfig

        try:
            rc = ReasoningConfig.parse(engine_args.reasoning)
        except ValueError as e:
            raise CLIError(str(e)) from None
        reasoning_ids = (rc.start_id, rc.end_id)
    elif reasoning_parser:
        logger.info("--reasoning-parser without --reasoning: outputs have no thinking span to split")
    keys = list(args.api_key or []) or env_api_key()
    fingerprint = _fingerprint(args, names[0], max_model_len, engine_args)
    settings = ServeSettings(
        served_model_names=list(names),
        model_root=model or names[0],
        max_model_len=max_model_len,
        engine_count=engine_count,
        api_keys=keys,
        scheduling_policy=engine_args.scheduling_policy,
        response_role=args.response_role,
        vocab_limit=max(tok.vocab_size, engine_args.vocab_size),
        force_include_usage=bool(args.enable_force_include_usage),
        prompt_tokens_details=bool(getattr(args, "enable_prompt_tokens_details", False)),
        reasoning_parser=reasoning_parser,
        reasoning_ids=reasoning_ids,
        engine_type=engine_args.engine_type,
        system_fingerprint=fingerprint,
        block_size=engine_args.tokens_per_block,
        num_gpu_blocks=engine_args.kv_cache_size,
        enable_prefix_caching=engine_args.enable_prefix_caching,
    )
    return settings, engine_args, tok, engine_count, ignored_flags(args)


def _fingerprint(args: argparse.Namespace, model: str, max_model_len: int, engine_args: EngineArgs) -> str | None:
    """vLLM's system_fingerprint: vllm-<version>-<8 hex of the configuration>."""
    mode = getattr(args, "fingerprint_mode", "full") or "full"
    if mode == "none":
        return None
    if mode == "custom":
        if not getattr(args, "fingerprint_value", None):
            raise CLIError("--fingerprint-value is required with --fingerprint-mode custom")
        return args.fingerprint_value
    import hashlib

    import msgspec

    digest = hashlib.sha256(msgspec.json.encode([model, max_model_len, engine_args])).hexdigest()[:8]
    return f"vllm-{VLLM_API_VERSION}-{digest}"


def _bind(host: str, port: int) -> socket.socket:
    """Claim the port at once, so a clash is reported before anything starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(False)
        return sock
    except socket.gaierror:
        raise
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class _Server(uvicorn.Server):
    """uvicorn, with our own signal handling: the first signal starts the engine shutdown
    (drain up to --shutdown-timeout, then abort) next to uvicorn's; no signal is re-raised, so
    the process exits 0."""

    def __init__(self, config: uvicorn.Config, on_exit: Any):
        super().__init__(config)
        self._on_exit = on_exit
        self._exit_started = False

    @contextlib.contextmanager
    def capture_signals(self):
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
            factory = functools.partial(self.config.http_protocol_class, config=self.config,
                                        server_state=self.server_state, app_state=self.lifespan.state)
            self.servers = [BurstAcceptor(sock, factory) for sock in sockets]

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self._exit_started:
            self._exit_started = True
            logger.info("received %s: shutting down", signal.Signals(sig).name if sig else "exit")
            self._on_exit()
        super().handle_exit(sig, frame)


async def serve(args: argparse.Namespace, *, sock: socket.socket | None = None) -> int:
    """Run `vllm-vcr serve` in the current event loop until a signal (or `should_exit`)."""
    t0 = time.perf_counter()
    settings, engine_args, tok, engine_count, ignored = build_settings_and_args(args)
    from ..engine.async_engine import AsyncEngine

    host = args.host or "0.0.0.0"
    if sock is None:
        try:
            sock = _bind(host, args.port)
        except socket.gaierror as e:
            raise CLIError(f"--host: cannot resolve {host!r}: {e.strerror or e}") from None
        except OSError as e:
            raise CLIError(f"--host/--port: {e.strerror or e}") from None
    kv_config = _kv_events_config(args)
    from ..engine.config import ConfigError
    from ..engine_inputs import engine_inputs

    try:
        engine = AsyncEngine(engine_args, engine_count=engine_count, **engine_inputs(engine_args))
    except ConfigError as e:  # a bad trace or replay table: name the flag, no traceback
        sock.close()
        raise CLIError(str(e)) from None
    publishers = _attach_kv_events(engine, kv_config)
    if getattr(args, "forward_pass_metrics_port", None) is not None:
        from ..fpm.attach import attach_fpm

        try:
            publishers += attach_fpm(engine.engines, args.forward_pass_metrics_port, host="0.0.0.0",
                                     worker_id=engine_args.engine_id, engine_type=engine_args.engine_type)
        except Exception as e:  # zmq.ZMQError: the port is taken
            sock.close()
            raise CLIError(f"--forward-pass-metrics-port: cannot bind {args.forward_pass_metrics_port}: {e}") from None
    await engine.start()
    control = None
    if getattr(args, "control_address", None):
        try:
            from ..control.server import start_control_server
        except ImportError:
            logger.warning("--control-address given but the control API is not available in this build")
        else:
            try:
                control = await start_control_server(engine, args.control_address)
            except Exception as e:
                await engine.stop(0)
                sock.close()
                raise CLIError(f"--control-address: {e}") from None
    from ..pd import start_pd_services

    try:
        pd = await start_pd_services(engine.engines, args)
    except OSError as e:
        await engine.stop(0)
        if control is not None:
            with contextlib.suppress(Exception):
                await control.stop()
        sock.close()
        raise CLIError(str(e)) from None
    sock.listen(2048)
    app: OpenAIApp = build_app(engine, tok, settings)

    stop_task: list[asyncio.Task] = []

    def begin_shutdown() -> None:
        # drain/abort the engines while uvicorn stops accepting and waits for open streams
        stop_task.append(asyncio.ensure_future(engine.stop()))

    config = uvicorn.Config(
        app,
        lifespan="off",
        http="httptools" if _has("httptools") else "h11",
        loop="none",
        log_config=None,
        log_level=args.uvicorn_log_level,
        access_log=bool(args.enable_access_log),
        server_header=True,  # "server: uvicorn", as vLLM's responses carry
        date_header=True,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=max(float(engine_args.shutdown_timeout), 0.0) + 5.0,
        backlog=2048,
        proxy_headers=False,  # no X-Forwarded-* rewriting: one middleware less per request
    )
    server = _Server(config, begin_shutdown)
    exit_code = 0
    loading: asyncio.Task | None = None
    if engine_args.startup_time > 0 or engine_args.startup_failure:
        # simulated model loading: the port is open, /health answers 503 and requests wait;
        # a loading failure fails every waiting request with its message, then the process exits 1
        logger.info("simulating model loading for %.1fs", engine_args.startup_time)

        async def watch_loading() -> None:
            nonlocal exit_code
            try:
                await engine.wait_ready()
            except Exception as e:
                logger.error("engine start-up failed: %s", e)
                exit_code = 1
                await asyncio.sleep(0.5)  # let the woken requests' error responses go out
                server.should_exit = True

        loading = asyncio.ensure_future(watch_loading())
    if ignored:
        logger.info("ignoring vLLM flags that mean nothing here: %s", " ".join(ignored))
    port = sock.getsockname()[1]
    logger.info("vllm-vcr serve: model %s, tokenizer %s (vocab %d), %d engine(s), max_model_len %d, "
                "listening on http://%s:%d (ready in %.0f ms)",
                ", ".join(settings.served_model_names), tok.source, tok.vocab_size, engine_count,
                settings.max_model_len, host, port, (time.perf_counter() - t0) * 1000)
    try:
        await server.serve(sockets=[sock])
    finally:
        if loading is not None:
            loading.cancel()
        if stop_task:
            await asyncio.gather(*stop_task, return_exceptions=True)
        await engine.stop()
        await pd.stop()
        if control is not None:
            with contextlib.suppress(Exception):
                await control.stop()
        for pub in publishers:
            with contextlib.suppress(Exception):
                pub.close()
        with contextlib.suppress(OSError):
            sock.close()
    return exit_code


def _kv_events_config(args: argparse.Namespace) -> Any:
    """--kv-events-config / --enable-kv-cache-events, when the kv_events package is present."""
    if getattr(args, "kv_events_config", None) is None and not getattr(args, "enable_kv_cache_events", False):
        return None
    try:
        from ..kv_events import KVEventsConfigError, kv_events_config_from_cli
    except ImportError:
        return None
    try:
        return kv_events_config_from_cli(args)
    except KVEventsConfigError as e:
        raise CLIError(str(e)) from None


def _attach_kv_events(engine: Any, config: Any) -> list[Any]:
    if config is None:
        return []
    from ..kv_events.attach import attach_kv_events

    try:
        return attach_kv_events(engine.engines, config)
    except OSError as e:  # the publisher's endpoint cannot be bound
        raise CLIError(f"--kv-events-config: {e}") from None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_server(args: argparse.Namespace) -> int:
    tune_for_serving()
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(args))
