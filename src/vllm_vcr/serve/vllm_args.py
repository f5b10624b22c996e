"""`vllm serve`'s options, from data: vllm_serve_args.json, dumped from the real vLLM frontends by
scripts/update_vllm_serve_args.py (tests/conformance/test_serve_flags.py regenerates it from the
installed vLLM releases and fails when an option is missing).

Every option of every release in the table is accepted with vLLM's option strings, value type
(the same conversion and error message), choices, default and nargs. An option the simulator
honours is listed in serve/cli.py's HONOURED table with what it does here; every other option is
accepted and ignored: parsed under an `ignored__` dest, reported once at start-up and marked in
`--help` with the reason (IGNORE_REASONS, by vLLM's config group, or per option).

Imports nothing heavy: the `vllm-vcr` parser is built on every invocation.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .ignored_flags import IGNORED_DEST_PREFIX

TABLE_PATH = Path(__file__).with_name("vllm_serve_args.json")

# Why an option of each vLLM config group means nothing here (an option's own reason wins).
IGNORE_REASONS: dict[str, str] = {
    "options": "process layout of a GPU deployment (one process serves here)",
    "Frontend": "a frontend feature the simulator does not reproduce",
    "ModelConfig": "no model weights are loaded",
    "LoadConfig": "no model weights are loaded",
    "AttentionConfig": "GPU attention kernels",
    "MambaConfig": "GPU state-space kernels",
    "StructuredOutputsConfig": "grammar backend of the GPU engine (vllm-vcr constrains outputs itself)",
    "ParallelConfig": "GPU parallelism (the engines are simulated in this process)",
    "CacheConfig": "GPU memory layout of the KV cache",
    "OffloadConfig": "GPU weight offloading",
    "MultiModalConfig": "multimodal encoders are not simulated",
    "LoRAConfig": "GPU LoRA kernels",
    "LoggingConfig": "a logging detail of vLLM's process",
    "ObservabilityConfig": "GPU tracing and profiling",
    "SchedulerConfig": "a GPU scheduler detail the simulated scheduler does not model",
    "CompilationConfig": "torch.compile and CUDA graphs",
    "KernelConfig": "GPU kernel selection",
    "VllmConfig": "GPU engine configuration",
}
OPTION_REASONS: dict[str, str] = {
    "--device-ids": "GPU selection",
    "--trust-remote-code": "no model code is run",
    "--dtype": "no weights are loaded (the frontend only reports it)",
    "--quantization": "no weights are loaded",
    "--gpu-memory-utilization": "used only by --perf-model aic to size the KV cache",
    "--tensor-parallel-size": "used only by --perf-model aic to price a step",
    "--kv-cache-dtype": "used only by --perf-model aic (fp8 halves the KV bytes)",
    "--async-scheduling": "used only by --perf-model aic (host time overlapped with the GPU's)",
    "--quantization-config": "used only by --perf-model aic (moe.activation: the MoE kernels' input precision)",
    "--max-cudagraph-capture-size": "used only by --perf-model aic with --perf-eager-layer-us (steps above it run without CUDA graphs)",
    "--cudagraph-capture-sizes": "used only by --perf-model aic with --perf-eager-layer-us (steps above the largest run without CUDA graphs)",
    "--compilation-config": "used only by --perf-model aic with --perf-eager-layer-us (its CUDA-graph mode and capture sizes)",
    "--enforce-eager": "used only by --perf-model aic with --perf-eager-layer-us (every step without CUDA graphs)",
    "--headless": "serve always runs its API server (`vllm-vcr play` is the headless engine)",
    "--uds": "serve listens on TCP only",
    "--middleware": "no user Python code is imported",
    "--max-logprobs": "logprobs requests are checked against vLLM 0.32's default of 20",
}


# --- vLLM's value types, reimplemented: the same conversions and the same error messages ---------

def _human_readable_int(value: str) -> int:
    """`4096`, `4k` (x1000), `4K` (x1024), up to t/T; binary suffixes take no decimals."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        try:
            return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. "
                f"Did you mean to use {number}{suffix.lower()} instead?") from None
    return int(value)


_human_readable_int.__name__ = "human_readable_int"


def _human_readable_int_or_auto(value: str) -> int:
    v = value.strip()
    if v == "-1" or v.lower() == "auto":
        return -1
    return _human_readable_int(v)


_human_readable_int_or_auto.__name__ = "human_readable_int_or_auto"


def loads(value: str) -> Any:  # named like json.loads: argparse's message says "invalid loads value"
    return json.loads(value)


def _dataclass_json(value: str) -> Any:
    """A JSON object (vLLM validates it against the config dataclass; here it is kept as parsed)."""
    expanded = re.sub(r'("(?:[^"\\]|\\.)*")|\b(\d+(?:\.\d+)?[kKmMgGtT])\b',
                      lambda m: m.group(1) or str(_human_readable_int(m.group(2))), value)
    try:
        parsed = json.loads(expanded)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON: {e}") from None
    return parsed


def _parse(cast: Callable[[str], Any], shown: str) -> Callable[[str], Any]:
    def _parse_type(value: str) -> Any:
        try:
            return cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"Value {value} cannot be converted to {shown}.") from None

    return _parse_type


def _optional(inner: Callable[[str], Any]) -> Callable[[str], Any]:
    def _optional_type(value: str) -> Any:
        return None if value in ("", "None") else inner(value)

    return _optional_type


def _union_dict_and_str(value: str) -> Any:
    if not re.match(r"(?s)^\s*{.*}\s*$", value):
        return value
    return _optional(_parse(json.loads, "<function loads>"))(value)


def _id_list(value: str) -> list[int | str]:
    return [int(p) if p.isdigit() else p for p in (part.strip() for part in value.split(","))]


_SHOWN = {"int": "<class 'int'>", "float": "<class 'float'>", "str": "<class 'str'>", "json": "<function loads>",
          "human_readable_int": "<function human_readable_int>", "dataclass_json": "<function parse_dataclass>"}
_BASE: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "json": loads, "dataclass_json": _dataclass_json,
    "human_readable_int": _human_readable_int, "human_readable_int_or_auto": _human_readable_int_or_auto,
    "union_dict_and_str": _union_dict_and_str, "id_list": _id_list,
    "lower_underscore": lambda s: s.lower().replace("-", "_"),
    "parse_reasoning_parser": lambda s: "" if s.lower() == "none" else s,
}


def converter(name: str) -> Callable[[str], Any]:
    """The `type=` callable for a type name of the table (`optional_int`, `parse_json`, ...)."""
    if name.startswith("optional_"):  # vLLM's optional_type(t) is optional_type(parse_type(t))
        inner = name[len("optional_"):]
        return _optional(_parse(converter(inner), _SHOWN.get(inner, inner)))
    if name.startswith("parse_") and name != "parse_reasoning_parser":
        inner = name[len("parse_"):]
        return _parse(converter(inner), _SHOWN.get(inner, inner))
    if name not in _BASE:
        raise KeyError(f"vllm_serve_args.json: unknown value type {name!r} (teach serve/vllm_args.py)")
    return _BASE[name]


class EnableDisableAction(argparse.Action):
    """vLLM's boolean flags: `--x`/`--no-x`, and in 0.33 also `--enable-x`/`--disable-x` pairs;
    the negative spellings store False."""

    def __init__(self, option_strings: list[str], dest: str, negative: list[str] = (), default: Any = None,
                 help: str | None = None, **kwargs: Any):
        self.negative = set(negative)
        super().__init__(option_strings, dest, nargs=0, default=default, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


# --- the table -------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def load_table() -> dict[str, Any]:
    return json.loads(TABLE_PATH.read_text(encoding="utf-8"))


def option_key(option: Mapping[str, Any]) -> str:
    """An option's name: its first option string (the dest for a positional)."""
    return option["option_strings"][0] if option["option_strings"] else option["dest"]


def merge_dumps(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """One table from the dumps of several releases (scripts/dump_vllm_serve_args.py), oldest
    first: an option's fields come from the newest release that has it; its option strings, the
    negative spellings of a boolean and its choices are the union (None choices: any value)."""
    options: dict[str, dict[str, Any]] = {}
    groups: dict[str, str] = {}
    for dump in dumps:
        version = ".".join(dump["vllm_version"].split(".")[:2])
        for g in dump["groups"]:
            groups[g["title"]] = g["description"]
        for opt in dump["options"]:
            key = opt["dest"]
            old = options.get(key)
            new = dict(opt, versions=[*(old["versions"] if old else []), version])
            if old is not None:
                new["option_strings"] = _union(old["option_strings"], opt["option_strings"])
                if opt["kind"] == "bool":
                    new["negative"] = sorted(set(old.get("negative", [])) | set(opt.get("negative", [])))
                if old["choices"] is None or opt["choices"] is None:
                    new["choices"] = None
                else:
                    new["choices"] = _union(old["choices"], opt["choices"])
            options[key] = new
    return {"vllm_versions": [".".join(d["vllm_version"].split(".")[:2]) for d in dumps],
            "groups": [{"title": t, "description": d} for t, d in groups.items()],
            "options": list(options.values())}


def _union(a: list, b: list) -> list:
    return [*a, *(x for x in b if x not in a)]


def spec_problems(table: Mapping[str, Any], dump: Mapping[str, Any]) -> list[str]:
    """What a release's dump has that the table does not accept as vLLM does: a missing option or
    option string, another kind or value type, a choice the table lacks, another default."""
    have = {o["dest"]: o for o in table["options"]}
    problems = []
    for opt in dump["options"]:
        name = option_key(opt)
        mine = have.get(opt["dest"])
        if mine is None:
            problems.append(f"{name}: missing")
            continue
        missing = [s for s in opt["option_strings"] if s not in mine["option_strings"]]
        if missing:
            problems.append(f"{name}: option strings {missing} missing")
        for field in ("kind", "type", "nargs"):
            if mine[field] != opt[field] and not (field == "type" and _optional_of(mine[field], opt[field])):
                problems.append(f"{name}: {field} {mine[field]!r}, vLLM {opt[field]!r}")
        if mine["choices"] is not None and (opt["choices"] is None
                                            or any(c not in mine["choices"] for c in opt["choices"])):
            problems.append(f"{name}: choices {mine['choices']!r}, vLLM {opt['choices']!r}")
    return problems


# (the table's type, a release's type) where the first accepts every value the second does
_WIDER = {("parse_reasoning_parser", "str")}


def _optional_of(a: str | None, b: str | None) -> bool:
    """`optional_str` accepts whatever `str` does (and "None"): a release that made a type optional;
    0.33's reasoning-parser type takes any string as 0.32's `str` does."""
    return a is not None and b is not None and (a == f"optional_{b}" or b == f"optional_{a}" or (a, b) in _WIDER)


# --- building the parser ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Honoured:
    """A vLLM option the simulator acts on: what it does here, and where the simulator's default
    or dest differs from vLLM's (said in the help)."""

    help: str
    default: Any = ...
    dest: str | None = None


IGNORED_MARK = "[accepted, ignored: {reason}] "


def ignore_reason(option: Mapping[str, Any]) -> str:
    names = option["option_strings"]
    for name in names:
        if name in OPTION_REASONS:
            return OPTION_REASONS[name]
    return IGNORE_REASONS.get(option["group"], "not simulated")


def add_vllm_options(parser: argparse.ArgumentParser, honoured: Mapping[str, Honoured],
                     groups: dict[str, Any] | None = None) -> dict[str, argparse._ArgumentGroup]:
    """Add every option of the table that the parser does not have yet, in vLLM's groups.

    An option already on the parser (one of the simulator's own definitions, e.g. the engine's
    --seed) keeps that definition. Returns the groups by vLLM title."""
    table = load_table()
    taken = parser._option_string_actions
    descriptions = {g["title"]: g["description"] for g in table["groups"]}
    out: dict[str, argparse._ArgumentGroup] = dict(groups or {})
    for opt in table["options"]:
        if not opt["option_strings"]:
            continue  # the positional MODEL is the simulator's own
        names = [s for s in opt["option_strings"] if s not in taken]
        if len(names) < len(opt["option_strings"]):
            if names:  # the simulator defines the option: vLLM's other spellings reach the same dest
                _add_aliases(parser, taken[next(s for s in opt["option_strings"] if s in taken)], names, opt)
            continue
        title = opt["group"]
        if title not in out:
            out[title] = parser.add_argument_group(title, descriptions.get(title))
        group = out[title]
        key = opt["option_strings"][0]
        spec = honoured.get(key)
        if spec is not None:
            dest = spec.dest or opt["dest"]
            default = opt["default"] if spec.default is ... else spec.default
            help_text = spec.help
        else:
            dest = IGNORED_DEST_PREFIX + opt["dest"]
            default = argparse.SUPPRESS
            vllm_help = opt["help"] or ""  # (argparse-escaped already: vLLM's parser formats it too)
            help_text = IGNORED_MARK.format(reason=ignore_reason(opt)) + vllm_help
        if default == "==SUPPRESS==":
            default = argparse.SUPPRESS if spec is None else None
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help_text}
        if kind_takes_value(opt):  # named after the option, whatever the dest
            kwargs["metavar"] = key.lstrip("-").upper().replace("-", "_")
        kind = opt["kind"]
        if kind == "bool":
            kwargs.update(action=EnableDisableAction, negative=opt.get("negative", []))
        elif kind in ("store_true", "store_false"):
            kwargs["action"] = kind
        else:
            kwargs["type"] = converter(opt["type"] or "str")
            if opt["choices"] is not None:
                kwargs["choices"] = [c for c in opt["choices"]]
                if any(c is None for c in opt["choices"]):
                    kwargs["choices"] = [c for c in opt["choices"] if c is not None] + [None]
            if opt["nargs"] is not None:
                kwargs["nargs"] = opt["nargs"]
            if kind == "append":
                kwargs["action"] = "append"
            if opt["metavar"] and not opt["metavar"].startswith("{"):
                kwargs["metavar"] = opt["metavar"]
            elif kwargs.get("choices") and len(kwargs["choices"]) <= 12 and None not in kwargs["choices"]:
                del kwargs["metavar"]  # argparse lists the choices: {a,b,c}
        action = group.add_argument(*opt["option_strings"], **kwargs)
        action.vllm_option = opt  # type: ignore[attr-defined]
        action.ignored = spec is None  # type: ignore[attr-defined]
    return out


def kind_takes_value(opt: Mapping[str, Any]) -> bool:
    return opt["kind"] in ("value", "append")


def _add_aliases(parser: argparse.ArgumentParser, existing: argparse.Action, names: list[str],
                 opt: Mapping[str, Any]) -> None:
    """vLLM's spellings of an option the simulator defines itself (0.33's `--disable-x` of a
    `--x/--no-x` flag, a short alias), hidden from --help: they store into the same dest."""
    if opt["kind"] == "bool":
        parser.add_argument(*names, dest=existing.dest, action=EnableDisableAction,
                            negative=[n for n in names if n in opt.get("negative", []) or n.startswith("--no-")],
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    elif existing.nargs != 0:
        parser.add_argument(*names, dest=existing.dest, type=existing.type, choices=existing.choices,
                            nargs=existing.nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def accepted_option_strings() -> set[str]:
    return {s for o in load_table()["options"] for s in o["option_strings"]}


# Values that make sense for options whose generic sample would not (tests/http/test_serve_flags.py
# and scripts/check_serve_flags.py start `vllm-vcr serve` with each option and such a value).
SAMPLE_VALUES: dict[str, list[str]] = {
    "--host": ["127.0.0.1"], "--served-model-name": ["sample-model"], "--api-key": ["sample-key"],
    "--max-model-len": ["1024"], "--tool-call-parser": ["hermes"], "--reasoning-parser": ["deepseek_r1"],
    "--chat-template": ["{{ messages[0]['content'] }}"], "--allowed-origins": ['["*"]'],
    "--allowed-methods": ['["*"]'], "--allowed-headers": ['["*"]'], "--kv-cache-memory-bytes": ["64M"],
    "--data-parallel-size": ["1"], "--data-parallel-rank": ["0"], "--log-level": ["INFO"],
    "--max-num-queued-reqs": ["64"], "--response-role": ["assistant"], "--fingerprint-value": ["fp-1"],
    "--lora-modules": ["a=/nonexistent-lora"], "--max-num-seqs": ["8"], "--max-num-batched-tokens": ["2048"],
    "--block-size": ["16"], "--stream-interval": ["1"], "--renderer-num-workers": ["1"],
    "--prefix-caching-hash-algo": ["sha256"], "--num-gpu-blocks-override": ["256"],
}


# Options vLLM accepts only together with another one (validate_parsed_serve_args).
SAMPLE_REQUIRES: dict[str, list[str]] = {
    "--enable-auto-tool-choice": ["--tool-call-parser", "hermes"],
    "--enable-log-outputs": ["--enable-log-requests"],
    "--lora-modules": ["--enable-lora"],
}


def sample_args(option: Mapping[str, Any], overrides: Mapping[str, list[str]] | None = None) -> list[str]:
    """The option with a value vLLM would accept: `--x` for a switch, else `--x VALUE`
    (`overrides` and SAMPLE_VALUES first)."""
    name = option_key(option)
    if option["kind"] in ("bool", "store_true", "store_false"):
        return [name, *SAMPLE_REQUIRES.get(name, [])]
    values = {**SAMPLE_VALUES, **(overrides or {})}
    if name in values:
        return [name, *values[name], *SAMPLE_REQUIRES.get(name, [])]
    choices = [c for c in option["choices"] or [] if c is not None]
    default = option["default"]
    kind = (option["type"] or "str").removeprefix("optional_").removeprefix("parse_")
    if choices:
        value = str(default) if default in choices else str(choices[0])
    elif kind in ("int", "human_readable_int", "human_readable_int_or_auto"):
        value = str(default) if isinstance(default, int) and not isinstance(default, bool) else "1"
    elif kind == "float":
        value = str(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else "0.5"
    elif kind in ("json", "dataclass_json"):
        value = json.dumps(default) if isinstance(default, (dict, list)) else "{}"
    elif kind == "id_list":
        value = "0"
    else:
        value = default if isinstance(default, str) and default not in ("", "==SUPPRESS==") else "sample"
    return [name, value]
