"""`vllm-vcr serve`: `vllm serve`'s command line in front of the simulated engine.

This module is imported for every `vllm-vcr` invocation (to build the parser), so it imports
nothing heavy at module level; `run()` pulls in the server.

GPU-only and model-loading flags of `vllm serve` are accepted and reported as ignored in one
log line, so a manifest written for vLLM starts this unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from ..engine_cli import add_engine_args
from ..kv_events.config import add_kv_events_args
from ..perf.cli import add_perf_args
from .ignored_flags import IGNORED_DEST_PREFIX as _IGN

DEFAULT_PORT = 8000
DEFAULT_MAX_MODEL_LEN = 4096

# vLLM flags that take a value and mean nothing without a GPU or a model (accepted, ignored).
_IGNORED_VALUE_FLAGS = [
    ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"), ("--data-parallel-size-local", "-dpl"),
    ("--data-parallel-address", "-dpa"), ("--data-parallel-rpc-port", "-dpp"), ("--data-parallel-start-rank", "-dpr"),
    ("--data-parallel-backend", "-dpb"), ("--decode-context-parallel-size", "-dcp"),
    ("--gpu-memory-utilization",), ("--dtype",), ("--kv-cache-dtype",), ("--quantization", "-q"),
    ("--swap-space",), ("--cpu-offload-gb",), ("--download-dir",), ("--load-format",), ("--tokenizer-mode",),
    ("--revision",), ("--code-revision",), ("--tokenizer-revision",), ("--max-logprobs",),
    ("--max-seq-len-to-capture",), ("--distributed-executor-backend",), ("--tool-call-parser",),
    ("--tool-parser-plugin",), ("--generation-config",),
    ("--override-generation-config",), ("--hf-overrides",), ("--compilation-config", "-O"),
    ("--speculative-config",), ("--max-num-partial-prefills",), ("--max-long-partial-prefills",),
    ("--guided-decoding-backend",), ("--structured-outputs-config",), ("--lora-modules",), ("--max-loras",),
    ("--max-lora-rank",), ("--max-cpu-loras",), ("--limit-mm-per-prompt",), ("--mm-processor-kwargs",),
    ("--allowed-origins",), ("--allowed-methods",), ("--allowed-headers",), ("--root-path",),
    ("--kv-events-config",),
    ("--ssl-keyfile",), ("--ssl-certfile",), ("--ssl-ca-certs",), ("--ssl-cert-reqs",), ("--middleware",),
    ("--api-server-count", "-asc"), ("--config",), ("--chat-template-content-format",),
    ("--kv-transfer-config",), ("--worker-extension-cls",),
    ("--otlp-traces-endpoint",), ("--collect-detailed-traces",), ("--num-gpu-blocks-override",),
    ("--logits-processor-pattern",), ("--logits-processors",), ("--model-impl",),
    ("--max-cudagraph-capture-size",), ("--cuda-graph-sizes",),
    ("--num-scheduler-steps",), ("--hf-token",), ("--uds",), ("--log-config-file",),
    ("--h11-max-incomplete-event-size",), ("--h11-max-header-count",), ("--max-parallel-loading-workers",),
    ("--served-model-task",), ("--task",), ("--runner",), ("--convert",), ("--seed-offset",),
    ("--scheduler-cls",), ("--stream-interval",), ("--default-chat-template-kwargs",),
    ("--tool-server",), ("--max-num-batched-tokens-per-step",), ("--enable-ssl-refresh-interval",),
    ("--mm-encoder-tp-mode",), ("--media-io-kwargs",), ("--allowed-local-media-path",),
    ("--preemption-mode",), ("--cpu-offload-params",), ("--ray-workers-use-nsight",),
    ("--served-model-timeout",), ("--model-loader-extra-config",), ("--ignore-patterns",),
    ("--override-neuron-config",), ("--override-pooler-config",), ("--pooler-config",),
]
# Boolean vLLM flags: `--x` and `--no-x` (BooleanOptionalAction), accepted and ignored.
_IGNORED_BOOL_FLAGS = [
    "--trust-remote-code", "--enforce-eager",
    "--enable-auto-tool-choice", "--enable-server-load-tracking", "--enable-request-id-headers",
    "--enable-lora", "--enable-sleep-mode", "--skip-tokenizer-init", "--enable-log-outputs",
    "--return-tokens-as-token-ids", "--headless", "--enable-expert-parallel", "--enable-eplb",
    "--disable-cascade-attn", "--enable-tokenizer-info-endpoint",
    "--exclude-tools-when-tool-choice-none", "--kv-sharing-fast-prefill", "--calculate-kv-scales",
    "--disable-sliding-window", "--disable-mm-preprocessor-cache", "--async-scheduling",
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
    """vLLM accepts `4096`, `4k`, `32K`, `1m` for --max-model-len."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}")
    num, unit = m.groups()
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024, "g": 10**9, "G": 1024**3}[unit]
    result = float(num) * scale
    if result != int(result):
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}")
    return int(result)


def _positive_int(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _port(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {v}")
    return v


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
    g.add("--port", type=_port, default=DEFAULT_PORT)
    g.add("--served-model-name", nargs="+", default=None, help="name(s) the API answers to")
    g.add("--max-model-len", type=_human_int, default=DEFAULT_MAX_MODEL_LEN,
          help=f"context length (default {DEFAULT_MAX_MODEL_LEN}); accepts 4k / 32K forms")
    g.add("--max-num-seqs", type=_positive_int, default=None, help="max running requests per engine")
    g.add("--max-num-batched-tokens", type=_positive_int, default=None, help="token budget per step")
    g.add("--block-size", type=_positive_int, default=None, help="tokens per KV block")
    g.add("--tokenizer", default=None, help="local HF tokenizer directory (never downloaded)")
    g.add("--data-parallel-size", "-dp", type=_positive_int, default=None,
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
    g.add("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add("--enable-access-log", action="store_true", help="log every HTTP request (off: it costs)")
    from ..faults.cli_args import add_fault_arguments

    add_fault_arguments(p)
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
    p.set_defaults(_serve_parser=p)
    return p


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
