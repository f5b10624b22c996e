"""`vllm-vcr serve`: `vllm serve`'s command line in front of the simulated engine.

This module is imported for every `vllm-vcr` invocation (to build the parser), so it imports
nothing heavy at module level; `run()` pulls in the server.

Every option of `vllm serve` (0.32, 0.33) is accepted: vllm_args.py adds them from the table dumped
from the real frontends; HONOURED says which ones the simulator acts on and what they do here; the
others are reported as ignored in one log line, so a manifest written for vLLM starts unchanged.
A new flag of the simulator's own is one `add_argument` line in its group below.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..cli_types import probability
from ..engine_cli import add_engine_args
from ..frontend.model_config import DEFAULT_MAX_MODEL_LEN
from ..kv_events.config import add_kv_events_args
from ..perf.cli import add_perf_args
from .vllm_args import Honoured, add_vllm_options

DEFAULT_PORT = 8000
from ..frontend.tools.calls import TOOL_CALL_PARSERS  # noqa: E402  (re-exported)

# The vLLM options the simulator acts on: the option (as vLLM's table names it) -> what it does
# here. Type, choices, nargs and (unless given here) the default come from vLLM's table
# (vllm_args.py); every vLLM option not listed is accepted and ignored. One line per option.
HONOURED: dict[str, Honoured] = {
    "--model": Honoured("same as MODEL (vLLM's default model is not assumed: without one the API serves "
                        "vllm-vcr/sim)", default=None, dest="model_opt"),
    "--host": Honoured("bind address (default: all interfaces, as vLLM)"),
    "--port": Honoured("TCP port"),
    "--served-model-name": Honoured("name(s) the API answers to"),
    "--config": Honoured("vLLM's config file: each `key: value` is the flag --key; flags on the command line win",
                         default=None),
    "--max-model-len": Honoured("context length; accepts 4k / 32K forms, -1 or auto = the model's. Default: derived "
                                f"from MODEL's config.json as vLLM does, else {DEFAULT_MAX_MODEL_LEN}"),
    "--disable-sliding-window": Honoured("cap the context length at the model's sliding window, as vLLM"),
    "--max-num-seqs": Honoured("max running requests per engine (default 128)"),
    "--max-num-batched-tokens": Honoured("token budget per engine step (default 2048)"),
    "--max-num-active-seqs": Honoured("how many requests may run at once (admission into RUNNING), at most "
                                      "--max-num-seqs, which keeps sizing the perf model's CUDA-graph capture; "
                                      "default: --max-num-seqs"),
    "--max-num-scheduled-tokens": Honoured("the tokens one engine step may schedule (default: "
                                           "--max-num-batched-tokens)"),
    "--max-num-queued-reqs": Honoured("admission limit on unfinished requests (waiting + running, n counts n): "
                                      "one more is refused with vLLM's 503"),
    "--max-num-queued-tokens": Honoured("admission limit on the prompt tokens of the requests in prefill (their "
                                        "first token not out yet, whole prompts counted): a request that comes "
                                        "while they are at it is refused with vLLM's 503"),
    "--block-size": Honoured("tokens per KV block (default 16)"),
    "--kv-cache-memory-bytes": Honoured("KV cache size in bytes (4G, 512m forms): blocks = bytes / (block size x "
                                        "the model's KV bytes per token, from config.json, else "
                                        "--kv-bytes-per-token)"),
    "--num-gpu-blocks-override": Honoured("KV cache size in blocks (overrides --kv-cache-size)"),
    "--tokenizer": Honoured("local HF tokenizer directory (never downloaded)"),
    "--generation-config": Honoured("the generation config, as vLLM reads it (auto: MODEL's generation_config.json; "
                                    "vllm: no sampling defaults; a folder: its own): its EOS ids (else config.json's) "
                                    "stop every request that does not ignore EOS; its sampling values (temperature, "
                                    "top_p, top_k, min_p, penalties) fill what a request leaves unset, its "
                                    "max_new_tokens is the output limit of a request that sets none (from a folder, "
                                    "of every request)"),
    "--override-generation-config": Honoured("JSON object merged over the generation config's sampling values and "
                                             "max_new_tokens (null removes one); its max_new_tokens limits every "
                                             "request, as vLLM"),
    "--data-parallel-size": Honoured("D > 1: one engine-core process per rank behind --api-server-count API "
                                     "servers (default D), as vLLM (docs/api-servers.md)"),
    "--api-server-count": Honoured("N API server processes sharing --port in front of one engine-core process "
                                   "per data-parallel rank, as vLLM (docs/api-servers.md); default: the "
                                   "--data-parallel-size; 1: one process, its engines in it"),
    "--data-parallel-rank": Honoured("this server is rank R of an external data-parallel deployment: its engine "
                                     "reports engine index R (the `engine` label of /metrics, KV events)"),
    "--enable-prefix-caching": Honoured("prefix caching in the simulated KV cache (default on)"),
    "--enable-chunked-prefill": Honoured("chunk long prefills across steps (default on)"),
    "--prefix-caching-hash-algo": Honoured("block hash of the prefix cache and KV events", default=None),
    "--api-key": Honoured("require `Authorization: Bearer KEY` on /v1 (also $VLLM_API_KEY)"),
    "--chat-template": Honoured("chat template file or inline jinja"),
    "--trust-request-chat-template": Honoured("render a chat_template sent in a request (bounded); without it such "
                                              "requests get a 400, as vLLM"),
    "--response-role": Honoured("role of generated chat messages"),
    "--default-chat-template-kwargs": Honoured("JSON object of chat template variables (e.g. '{\"enable_thinking\": "
                                               "false}'); a request's chat_template_kwargs override them"),
    "--exclude-tools-when-tool-choice-none": Honoured("a request with tool_choice \"none\" renders its prompt "
                                                      "without its tools, as vLLM"),
    "--chat-template-content-format": Honoured("how a chat template gets message content: string (text parts "
                                               "joined by newlines) or openai (a list of text parts); auto: "
                                               "openai for a template that loops over a message's content, as "
                                               "vLLM detects it"),
    "--enable-per-request-metrics": Honoured("a response's `metrics` (its non-streamed body, a stream's usage "
                                             "chunk): TTFT, queue, decode time, mean ITL and tokens/s of one "
                                             "sequence, from the engine's timestamps, as vLLM"),
    "--sse-keep-alive-interval": Honoured("an SSE comment line (`: keep-alive`) whenever a chat or completion "
                                          "stream has been idle this many seconds (0: never), as vLLM"),
    "--disable-fastapi-docs": Honoured("no /openapi.json, /docs or /redoc (404), as vLLM"),
    "--return-tokens-as-token-ids": Honoured("logprobs name each token `token_id:N` (a request's "
                                             "return_tokens_as_token_ids decides for itself)"),
    "--enable-force-include-usage": Honoured("usage chunk on every stream"),
    "--enable-prompt-tokens-details": Honoured("usage.prompt_tokens_details.cached_tokens (the prefix-cache hit)"),
    "--fingerprint-mode": Honoured("system_fingerprint: vllm-<version>-<hash8> (full/hash), --fingerprint-value, "
                                   "or none"),
    "--fingerprint-value": Honoured("system_fingerprint with --fingerprint-mode custom"),
    "--reasoning-parser": Honoured("any name: chat answers split `reasoning` from `content` at the --reasoning "
                                   "markers"),
    "--enable-auto-tool-choice": Honoured("let chat requests use tool_choice auto (needs --tool-call-parser)"),
    "--tool-call-parser": Honoured("the format simulated tool calls are written in and parsed from: "
                                   + ", ".join(TOOL_CALL_PARSERS)),
    "--enable-scale-out": Honoured("serve /inference/v1/generate and the render endpoints (else vLLM's 403)"),
    "--tokens-only": Honoured("same routes as --enable-scale-out"),
    "--uvicorn-log-level": Honoured("uvicorn's log level; default: VLLM_VCR_LOG / RUST_LOG decide (target "
                                    "`uvicorn`), as for every other logger", default=None),
    "--log-level": Honoured("log level of the whole process (same as VLLM_VCR_LOG=<level>)"),
    "--enable-log-requests": Honoured("log each request's arrival and finish (same as --log-requests); not given: "
                                      "--log-requests / MOCK_LOG_REQUESTS decide", default=None),
    "--stream-interval": Honoured("tokens per streamed SSE event: 1 sends every token as its own event (merging "
                                  "only when the client lags), N > 1 up to N tokens per event"),
    "--renderer-num-workers": Honoured("threads that tokenize long new prompts off the event loop"),
    "--enable-request-id-headers": Honoured("X-Request-Id on every response (the request's own, else a uuid4 hex)"),
    "--allowed-origins": Honoured('CORS: JSON list of allowed origins, e.g. \'["*"]\' (none by default)'),
    "--allowed-methods": Honoured("CORS: JSON list of allowed methods"),
    "--allowed-headers": Honoured("CORS: JSON list of allowed headers"),
    "--allow-credentials": Honoured("CORS: allow credentials"),
    "--grpc": Honoured("serve the VllmEngine gRPC service (smg-grpc-proto) on --port instead of the HTTP API "
                       "(docs/grpc.md)"),
    "--ssl-keyfile": Honoured("HTTPS: the server's private key (PEM)"),
    "--ssl-certfile": Honoured("HTTPS: the server's certificate chain (PEM)"),
    "--ssl-ca-certs": Honoured("HTTPS: CA certificates to verify client certificates with"),
    "--ssl-cert-reqs": Honoured("HTTPS: whether a client certificate is required (the ssl module's CERT_NONE=0, "
                                "CERT_OPTIONAL=1, CERT_REQUIRED=2)"),
    "--ssl-ciphers": Honoured("HTTPS: the cipher suites to offer (OpenSSL cipher list)"),
}
# What `serve --help` shows first (then the list of groups).
FIRST_SCREEN = ("--host", "--port", "--model", "--served-model-name", "--api-key", "--max-model-len",
                "--config", "--time-to-first-token", "--inter-token-latency", "--kv-cache-size", "--max-num-seqs",
                "--mode", "--control-address", "--perf-model")


class _Group:
    """An argument group that skips flags the parser already has (the engine's own flags come
    first)."""

    def __init__(self, parser: argparse.ArgumentParser, title: str):
        self._parser = parser
        self._group = parser.add_argument_group(title)

    def add(self, *names: str, **kwargs: Any) -> None:
        taken = self._parser._option_string_actions
        if any(n in taken for n in names if n.startswith("-")):
            return
        self._group.add_argument(*names, **kwargs)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from .help import ServeParser

    p = ServeParser.add_to(
        subparsers, "serve", help="serve the OpenAI-compatible API (a drop-in for `vllm serve`)",
        description="Run an OpenAI-compatible server (vLLM's frontend) in front of the simulated engine. "
                    "Accepts every option of `vllm serve` (0.32, 0.33); those that only concern GPUs or "
                    "model weights are accepted and ignored.",
        first_screen=FIRST_SCREEN)
    add_arguments(p)
    global _PARSER
    _PARSER = p
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """serve's arguments (MODEL, its own flags, every `vllm serve` option) on `p`: serve's parser,
    or `fleet`'s, whose workers take the same flags."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model name, or a local directory with tokenizer.json (served under this name)")
    add_engine_args(p)
    add_kv_events_args(p)
    add_perf_args(p)
    g = p.add_argument_group("vllm-vcr server", "The simulated server's own options.")
    g.add_argument("--auto-tool-call-probability", type=probability, default=1.0,
                   help='how often tool_choice "auto" calls a tool')
    g.add_argument("--enable-access-log", action="store_true", help="log every HTTP request (off: it costs)")
    from ..faults.cli_args import add_fault_arguments

    add_fault_arguments(p)
    from .extension_args import add_extension_args

    add_extension_args(_Group(p, "LoRA adapters, sleep mode, pooling runner"))
    add_vllm_options(p, HONOURED)  # every other option of `vllm serve`, from vLLM's table
    for action in p._actions:  # --help shows the default of a flag without a help line
        if action.help is None and action.option_strings and action.default is not None:
            action.help = "(default: %(default)s)"
    p.set_defaults(_serve_parser=p)


_PARSER: argparse.ArgumentParser | None = None


def expand_argv(argv: list[str]) -> list[str]:
    """`serve ... --config FILE.yaml`: the file's flags spliced in before parsing (vLLM's order),
    then vLLM's argument forms made plain (help.py: `--help=x`, `--a_b`, `--x.key v`, `-O3`)."""
    from .config_file import ConfigFileError, expand_config_file

    parser = _PARSER
    known = parser._option_string_actions if parser is not None else {}
    try:
        argv = expand_config_file(argv, lambda flag: flag in known or flag.replace("_", "-") in known)
    except ConfigFileError as e:
        if parser is None:
            raise
        parser.error(str(e))  # exits 2
        raise  # pragma: no cover
    return argv[:1] + parser.normalise(argv[1:]) if parser is not None else argv


def default_api_server_count(args: argparse.Namespace) -> int:
    """vLLM's default for `--api-server-count` (its serve command, internal load balancing): the
    data-parallel size; 1 for one rank of an external load balancer (`--data-parallel-rank`) and
    with `--grpc` (vLLM's gRPC server takes its own path first). Given explicitly, the count as
    given: 1 keeps the engines in the one process."""
    count = getattr(args, "api_server_count", None)
    if count is not None:
        return int(count)
    if getattr(args, "grpc", False) or getattr(args, "data_parallel_rank", None) is not None:
        return 1
    return int(getattr(args, "data_parallel_size", None) or 1)


def run(args: argparse.Namespace) -> int:
    from ..logging_setup import apply_log_level
    from .settings import CLIError

    try:
        apply_log_level(getattr(args, "log_level", None))
        count = getattr(args, "api_server_count", None)
        if count is not None and count < 1:
            raise CLIError(f"--api-server-count: must be >= 1, got {count}")
        given = getattr(args, "api_server_count", None)
        count = args.api_server_count = default_api_server_count(args)
        if count > 1:  # vLLM's process shape (api_servers.py)
            from .api_servers import run_api_servers

            return run_api_servers(args, defaulted=given is None)
        from .server import run_server

        return run_server(args)
    except CLIError as e:
        parser = getattr(args, "_serve_parser", None)
        prog = parser.prog if parser is not None else "vllm-vcr serve"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
