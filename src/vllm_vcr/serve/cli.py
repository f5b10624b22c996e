"""`vllm-vcr serve`: `vllm serve`'s command line in front of the simulated engine.

This module is imported for every `vllm-vcr` invocation (to build the parser), so it imports
nothing heavy at module level; `run()` pulls in the server.

GPU-only and model-loading flags of `vllm serve` are accepted and reported as ignored in one
log line, so a manifest written for vLLM starts this unchanged.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from ..cli_types import port_number, positive_int, probability
from ..engine_cli import add_engine_args
from ..frontend.model_config import DEFAULT_MAX_MODEL_LEN
from ..kv_events.config import add_kv_events_args
from ..perf.cli import add_perf_args
from .ignored_flags import IGNORED_DEST_PREFIX as _IGN

DEFAULT_PORT = 8000

# vLLM flags that take a value and mean nothing without a GPU or a model (accepted, ignored).
_IGNORED_VALUE_FLAGS = [
    ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"), ("--data-parallel-size-local", "-dpl"),
    ("--data-parallel-address", "-dpa"), ("--data-parallel-rpc-port", "-dpp"), ("--data-parallel-start-rank", "-dpr"),
    ("--data-parallel-backend", "-dpb"), ("--decode-context-parallel-size", "-dcp"),
    ("--gpu-memory-utilization",), ("--dtype",), ("--kv-cache-dtype",), ("--quantization", "-q"),
    ("--swap-space",), ("--cpu-offload-gb",), ("--download-dir",), ("--load-format",), ("--tokenizer-mode",),
    ("--revision",), ("--code-revision",), ("--tokenizer-revision",), ("--max-logprobs",),
    ("--max-seq-len-to-capture",), ("--distributed-executor-backend",),
    ("--tool-parser-plugin",), ("--generation-config",),
    ("--override-generation-config",), ("--hf-overrides",), ("--compilation-config", "-O"),
    ("--speculative-config",), ("--max-num-partial-prefills",), ("--max-long-partial-prefills",),
    ("--guided-decoding-backend",), ("--structured-outputs-config",), ("--lora-modules",), ("--max-loras",),
    ("--max-lora-rank",), ("--max-cpu-loras",), ("--limit-mm-per-prompt",), ("--mm-processor-kwargs",),
    ("--root-path",),
    ("--kv-events-config",),
    ("--ssl-keyfile",), ("--ssl-certfile",), ("--ssl-ca-certs",), ("--ssl-cert-reqs",), ("--middleware",),
    ("--api-server-count", "-asc"), ("--chat-template-content-format",),
    ("--kv-transfer-config",), ("--worker-extension-cls",),
    ("--otlp-traces-endpoint",), ("--collect-detailed-traces",), ("--num-gpu-blocks-override",),
    ("--logits-processor-pattern",), ("--logits-processors",), ("--model-impl",),
    ("--max-cudagraph-capture-size",), ("--cuda-graph-sizes",),
    ("--num-scheduler-steps",), ("--hf-token",), ("--uds",), ("--log-config-file",),
    ("--h11-max-incomplete-event-size",), ("--h11-max-header-count",), ("--max-parallel-loading-workers",),
    ("--served-model-task",), ("--task",), ("--runner",), ("--convert",), ("--seed-offset",),
    ("--scheduler-cls",), ("--default-chat-template-kwargs",),
    ("--tool-server",), ("--max-num-batched-tokens-per-step",), ("--enable-ssl-refresh-interval",),
    ("--mm-encoder-tp-mode",), ("--media-io-kwargs",), ("--allowed-local-media-path",),
    ("--preemption-mode",), ("--cpu-offload-params",), ("--ray-workers-use-nsight",),
    ("--served-model-timeout",), ("--model-loader-extra-config",), ("--ignore-patterns",),
    ("--override-neuron-config",), ("--override-pooler-config",), ("--pooler-config",),
]
# Boolean vLLM flags: `--x` and `--no-x` (BooleanOptionalAction), accepted and ignored.
_IGNORED_BOOL_FLAGS = [
    "--trust-remote-code", "--enforce-eager",
    "--enable-lora", "--enable-sleep-mode", "--skip-tokenizer-init", "--enable-log-outputs",
    "--return-tokens-as-token-ids", "--headless", "--enable-expert-parallel", "--enable-eplb",
    "--disable-cascade-attn", "--enable-tokenizer-info-endpoint",
    "--exclude-tools-when-tool-choice-none", "--kv-sharing-fast-prefill", "--calculate-kv-scales",
    "--disable-mm-preprocessor-cache", "--async-scheduling",
    "--disable-custom-all-reduce", "--enable-mfu-metrics", "--use-tqdm-on-load", "--enable-dbo",
    "--disable-chunked-mm-input", "--enable-log-requests", "--fully-sharded-loras",
    "--disable-hybrid-kv-cache-manager", "--enable-lora-bias", "--multi-step-stream-outputs",
]
# `--disable-*` switches of vLLM (store_true).
_IGNORED_SWITCHES = [
    "--disable-log-requests", "--disable-log-stats", "--disable-frontend-multiprocessing",
    "--disable-fastapi-docs", "--disable-uvicorn-access-log", "--disable-async-output-proc",
]



def _human_int(value: str) -> int:
    """vLLM accepts `4096`, `4k`, `32K`, `1m` for --max-model-len, and -1 (the model's length)."""
    if value.strip() == "-1":
        return -1
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}")
    num, unit = m.groups()
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024, "g": 10**9, "G": 1024**3}[unit]
    result = float(num) * scale
    if result != int(result):
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}")
    return int(result)


def _json_list(flag: str) -> Any:
    """vLLM parses --allowed-origins/-methods/-headers with json.loads: a JSON list of strings."""

    def parse(value: str) -> list[str]:
        import json

        try:
            items = json.loads(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list, e.g. '[\"*\"]', got {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings, got {value!r}")
        return items

    return parse


class _Group:
    """An argument group that skips flags the parser already has: the engine's own flags come
    first, and a vLLM flag the engine starts to honour later must not clash with ours."""

    def __init__(self, parser: argparse.ArgumentParser, title: str):
        self._parser = parser
        self._group = parser.add_argument_group(title)

    def add(self, *names: str, **kwargs: Any) -> None:
        taken = self._parser._option_string_actions
        if any(n in taken for n in names if n.startswith("-")):
            return
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            if any("--no-" + n[2:] in taken for n in names if n.startswith("--")):
                return
        self._group.add_argument(*names, **kwargs)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API (a drop-in for `vllm serve`)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run an OpenAI-compatible server (vLLM's frontend) in front of the simulated engine. "
                    "Accepts `vllm serve`'s command line; GPU-only flags are ignored.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model name, or a local directory with tokenizer.json (served under this name)")
    add_engine_args(p)
    if "--kv-events-config" not in p._option_string_actions:  # vLLM's KV cache events flags
        add_kv_events_args(p)
    add_perf_args(p)
    g = _Group(p, "vLLM server")
    g.add("--model", dest="model_opt", default=None, help="same as MODEL")
    g.add("--host", default=None, help="bind address (default: all interfaces, as vLLM)")
    g.add("--port", type=port_number, default=DEFAULT_PORT)
    g.add("--served-model-name", nargs="+", default=None, help="name(s) the API answers to")
    g.add("--config", default=None, metavar="FILE.yaml",
          help="vLLM's config file: each `key: value` is the flag --key; flags on the command line win")
    g.add("--max-model-len", type=_human_int, default=None,
          help="context length; accepts 4k / 32K forms, -1 = the model's. Default: derived from MODEL's "
               f"config.json as vLLM does, else {DEFAULT_MAX_MODEL_LEN}")
    g.add("--disable-sliding-window", action=argparse.BooleanOptionalAction, default=False,
          help="cap the context length at the model's sliding window, as vLLM")
    g.add("--max-num-seqs", type=positive_int, default=None, help="max running requests per engine")
    g.add("--max-num-batched-tokens", type=positive_int, default=None, help="token budget per step")
    g.add("--block-size", type=positive_int, default=None, help="tokens per KV block")
    g.add("--tokenizer", default=None, help="local HF tokenizer directory (never downloaded)")
    g.add("--data-parallel-size", "-dp", type=positive_int, default=None,
          help="engines in this process (same as --engine-count)")
    g.add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
          help="prefix caching in the simulated KV cache (default on)")
    g.add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
          help="chunk long prefills across steps (default on)")
    g.add("--prefix-caching-hash-algo", default=None, help="block hash of the prefix cache and KV events")
    g.add("--api-key", nargs="+", default=None, help="require `Authorization: Bearer KEY` on /v1")
    g.add("--chat-template", default=None, help="chat template file or inline jinja")
    g.add("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
          help="render a chat_template sent in a request (bounded); without it such requests get a 400, as vLLM")
    g.add("--response-role", default="assistant")
    g.add("--enable-force-include-usage", action="store_true", help="usage chunk on every stream")
    g.add("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
          help="usage.prompt_tokens_details.cached_tokens (the prefix-cache hit), as vLLM")
    g.add("--fingerprint-mode", choices=["full", "hash", "custom", "none"], default="full",
          help="system_fingerprint: vllm-<version>-<hash8> (full/hash), --fingerprint-value, or none")
    g.add("--fingerprint-value", default=None, help="system_fingerprint with --fingerprint-mode custom")
    g.add("--reasoning-parser", default=None,
          help="any name: chat answers split `reasoning` from `content` at the --reasoning markers")
    g.add("--enable-auto-tool-choice", action="store_true",
          help="let chat requests use tool_choice auto (needs --tool-call-parser), as vLLM")
    g.add("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
          help="the format simulated tool calls are written in and parsed from")
    g.add("--auto-tool-call-probability", type=probability, default=1.0,
          help='how often tool_choice "auto" calls a tool (default 1.0)')
    g.add("--enable-scale-out", action="store_true",
          help="serve /inference/v1/generate and the render endpoints (else vLLM's 403)")
    g.add("--tokens-only", action="store_true", help="same routes as --enable-scale-out")
    g.add("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug", "trace"],
          help="uvicorn's log level; default: VLLM_VCR_LOG / RUST_LOG decide (target `uvicorn`), as for "
               "every other logger")
    g.add("--enable-access-log", action="store_true", help="log every HTTP request (off: it costs)")
    g.add("--stream-interval", type=positive_int, default=1,
          help="tokens per streamed SSE event: 1 sends every token as its own event (merging only when the "
               "client lags), N > 1 up to N tokens per event (the first and last go out at once)")
    g.add("--renderer-num-workers", type=positive_int, default=1,
          help="threads that tokenize long new prompts off the event loop (vLLM's renderer pool)")
    g.add("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
          help="X-Request-Id on every response (the request's own, else a random uuid4 hex)")
    g.add("--allowed-origins", type=_json_list("--allowed-origins"), default=[],
          help='CORS: JSON list of allowed origins, e.g. \'["*"]\' (none by default: cross-origin access off)')
    g.add("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"],
          help="CORS: JSON list of allowed methods")
    g.add("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"],
          help="CORS: JSON list of allowed headers")
    g.add("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
          help="CORS: allow credentials")
    add_transport_args(_Group(p, "gRPC engine API and TLS (vLLM's --grpc and --ssl-* flags)"))
    from ..faults.cli_args import add_fault_arguments

    add_fault_arguments(p)
    from .extension_args import add_extension_args

    add_extension_args(_Group(p, "LoRA adapters, sleep mode, pooling runner"))
    ig = _Group(p, "accepted for compatibility with `vllm serve`, ignored")
    for names in _IGNORED_VALUE_FLAGS:
        ig.add(*names, dest=_IGN + names[0][2:].replace("-", "_"), default=argparse.SUPPRESS,
               metavar="V", help=argparse.SUPPRESS)
    for name in _IGNORED_BOOL_FLAGS:
        ig.add(name, dest=_IGN + name[2:].replace("-", "_"), action=argparse.BooleanOptionalAction,
               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for name in _IGNORED_SWITCHES:
        ig.add(name, dest=_IGN + name[2:].replace("-", "_"), action="store_true",
               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for action in p._actions:  # --help shows every default, flags without a help line included
        if action.help is None and action.option_strings:
            action.help = "(default: %(default)s)"
    p.set_defaults(_serve_parser=p)
    global _PARSER
    _PARSER = p
    return p


def add_transport_args(g: _Group) -> None:
    """How serve listens: vLLM's gRPC server instead of HTTP (--grpc), HTTPS (--ssl-*)."""
    g.add("--grpc", action="store_true",
          help="serve the VllmEngine gRPC service (smg-grpc-proto) on --port instead of the HTTP API, "
               "as `vllm serve --grpc`")
    g.add("--ssl-keyfile", default=None, help="HTTPS: the server's private key (PEM)")
    g.add("--ssl-certfile", default=None, help="HTTPS: the server's certificate chain (PEM)")
    g.add("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to verify client certificates with")
    g.add("--ssl-cert-reqs", type=int, default=0,
          help="HTTPS: whether a client certificate is required (the ssl module's CERT_NONE=0, "
               "CERT_OPTIONAL=1, CERT_REQUIRED=2)")
    g.add("--ssl-ciphers", default=None, help="HTTPS: the cipher suites to offer (OpenSSL cipher list)")
    g.add("--enable-ssl-refresh", dest=_IGN + "enable_ssl_refresh", action="store_true", default=argparse.SUPPRESS,
          help="accepted and ignored: the certificate files are read once, at start-up")


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic")


_PARSER: argparse.ArgumentParser | None = None


def expand_argv(argv: list[str]) -> list[str]:
    """`serve ... --config FILE.yaml`: the file's flags spliced in before parsing (vLLM's order)."""
    from .config_file import ConfigFileError, expand_config_file

    parser = _PARSER
    known = parser._option_string_actions if parser is not None else {}
    try:
        return expand_config_file(argv, lambda flag: flag in known)
    except ConfigFileError as e:
        if parser is None:
            raise
        parser.error(str(e))  # exits 2
        raise  # pragma: no cover


def run(args: argparse.Namespace) -> int:
    from .server import run_server
    from .settings import CLIError

    try:
        return run_server(args)
    except CLIError as e:
        parser = getattr(args, "_serve_parser", None)
        prog = parser.prog if parser is not None else "vllm-vcr serve"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
