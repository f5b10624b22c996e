"""The command-line flags of serve/extensions.py (LoRA, sleep mode, pooling runner).

Kept free of heavy imports: the `vllm-vcr` parser is built on every invocation.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..cli_types import one_of, positive_int
from ..vllm.lora import LoRAModulePath

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


def parse_lora_modules(values: list[str]) -> list[LoRAModulePath]:
    """`name=path` items, or JSON objects with LoRAModulePath's fields (vLLM's LoRAParserAction)."""
    out: list[LoRAModulePath] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            out.append(LoRAModulePath(name, path))
            continue
        try:
            fields = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            if not isinstance(fields, dict):
                raise TypeError(f"expected a JSON object, got {type(fields).__name__}")
            out.append(LoRAModulePath(**fields))
        except TypeError as e:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None
    return out


class _LoRAModulesAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, parse_lora_modules(list(values or [])))
        except ValueError as e:
            parser.error(str(e))


_lora_rank = one_of(int, MAX_LORA_RANKS)


def add_lora_args(group: Any) -> None:
    """vLLM's LoRA flags plus the simulated load time (`group.add` skips flags already taken)."""
    group.add("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
              help="serve LoRA adapters (--lora-modules, /v1/load_lora_adapter)")
    group.add("--lora-modules", nargs="+", action=_LoRAModulesAction, default=None, metavar="NAME=PATH|JSON",
              help='adapters loaded at start-up: name=path, or {"name":..,"path":..,"base_model_name":..}')
    group.add("--max-loras", type=positive_int, default=1, help="distinct adapters in one batch (vLLM default 1)")
    group.add("--max-lora-rank", type=_lora_rank, default=16, help="largest adapter rank accepted (default 16)")
    group.add("--max-cpu-loras", type=positive_int, default=None,
              help="adapters kept in the CPU pool (>= --max-loras; default --max-loras)")
    group.add("--lora-load-time", type=float, default=0.0, metavar="MS",
              help="simulated time to read an adapter from disk: first use, or after the CPU pool dropped it (ms)")
    group.add("--lora-swap-in-time", type=float, default=0.0, metavar="MS",
              help="simulated time to copy an adapter from the CPU pool into one of the --max-loras slots (ms)")


def add_sleep_args(group: Any) -> None:
    group.add("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False,
              help="sleep releases the (simulated) weights and KV cache, taking --sleep-time/--wake-up-time")
    group.add("--sleep-time", type=float, default=0.0, metavar="MS",
              help="simulated time to offload/discard on POST /sleep level >= 1 (ms, with --enable-sleep-mode)")
    group.add("--wake-up-time", type=float, default=0.0, metavar="MS",
              help="simulated time to reload on POST /wake_up (ms, with --enable-sleep-mode)")


def add_pooling_args(group: Any) -> None:
    """vLLM 0.32's runner selection; a pooling runner serves embeddings instead of generation."""
    group.add("--runner", choices=["auto", "generate", "pooling", "draft"], default="auto",
              help="generate (default) or pooling: /v1/embeddings, /pooling, /score, /rerank")
    group.add("--convert", choices=["auto", "none", "embed", "classify"], default="auto",
              help="with --runner pooling: the pooling task (embed; classify is not simulated)")
    group.add("--embedding-size", type=positive_int, default=None, metavar="N",
              help="dimensions of the simulated embeddings (default: hidden_size of MODEL/config.json, else 1024)")
    group.add("--is-matryoshka", action=argparse.BooleanOptionalAction, default=None,
              help="accept the `dimensions` request field (default: the model's config.json says)")


def add_extension_args(group: Any) -> None:
    group.add("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
              help="count in-flight generation/pooling requests for GET /load, as vLLM")
    add_lora_args(group)
    add_sleep_args(group)
    add_pooling_args(group)
