"""Dump the options of `vllm serve` as data: run with the python of a venv that has vLLM.

    VLLM_TARGET_DEVICE=cpu ~/.cache/vllm-vcr/peers/vllm-0.33/bin/python scripts/dump_vllm_serve_args.py > 0.33.json

Builds the serve parser the way `vllm serve` does (ServeSubcommand.subparser_init under a
FlexibleArgumentParser) and writes, per option: its option strings, dest, group, kind (bool /
store_true / value / append), the value type (a name vllm-vcr's parser maps to the same
conversion and error message), choices, default, nargs, metavar, help and whether it is
deprecated. `scripts/update_vllm_serve_args.py` merges the dumps of several versions into
src/vllm_vcr/serve/vllm_serve_args.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
sys.argv.append("--help")  # vLLM reads its config docstrings (the options' help) only when asked for help


def _closure_type(fn) -> str:
    for cell in fn.__closure__ or ():
        inner = cell.cell_contents
        if callable(inner):
            return _type_name(inner)
    return "str"


def _type_name(t) -> str:
    """A stable name for an argparse `type=` callable of vLLM's."""
    if t is None:
        return "str"
    name = getattr(t, "__qualname__", "") or ""
    module = getattr(t, "__module__", "") or ""
    if t in (int, float, str):
        return t.__name__
    if module == "json" and name == "loads":
        return "json"
    if name.startswith("optional_type."):
        return "optional_" + _closure_type(t)
    if name.startswith("parse_type."):
        return "parse_" + _closure_type(t)
    if name.endswith("parse_dataclass"):
        return "dataclass_json"
    if name in ("union_dict_and_str", "human_readable_int", "human_readable_int_or_auto",
                "parse_reasoning_parser"):
        return name
    if "<lambda>" in name:
        probe = {}
        for text in ("1,2", "A-b"):
            try:
                probe[text] = t(text)
            except Exception as e:  # noqa: BLE001
                probe[text] = repr(e)
        if probe.get("1,2") == [1, 2]:
            return "id_list"
        if probe.get("A-b") == "a_b":
            return "lower_underscore"
    return f"unknown:{module}.{name}"


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, (set, frozenset, tuple)):
            return [_jsonable(v) for v in value]
        if hasattr(value, "value") and isinstance(getattr(value, "value"), (str, int)):
            return value.value  # an enum
        return repr(value)


def dump() -> dict:
    import vllm
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    parser = ServeSubcommand().subparser_init(top.add_subparsers())
    groups = []
    options = []
    for group in parser._action_groups:
        if not group._group_actions:
            continue
        groups.append({"title": group.title, "description": " ".join((group.description or "").split("\n\n", 1)[0]
                                                                      .split())})
        for a in group._group_actions:
            if isinstance(a, argparse._HelpAction):
                continue
            cls = type(a).__name__
            if isinstance(a, argparse.BooleanOptionalAction):
                kind = "bool"
            elif isinstance(a, argparse._StoreTrueAction):
                kind = "store_true"
            elif isinstance(a, argparse._StoreFalseAction):
                kind = "store_false"
            elif isinstance(a, argparse._AppendAction):
                kind = "append"
            else:
                kind = "value"
            entry = {
                "option_strings": list(a.option_strings),
                "dest": a.dest,
                "group": group.title,
                "kind": kind,
                "action": cls,
                "type": _type_name(a.type) if kind in ("value", "append") else None,
                "choices": [_jsonable(c) for c in a.choices] if a.choices is not None else None,
                "default": _jsonable(a.default),
                "nargs": a.nargs if kind in ("value", "append") else None,
                "metavar": a.metavar if isinstance(a.metavar, str) else None,
                "help": None if a.help == argparse.SUPPRESS else a.help,
                "deprecated": a in getattr(parser, "_deprecated", ()),
            }
            if kind == "bool":
                entry["negative"] = sorted(getattr(a, "negative_option_strings", None)
                                           or [o for o in a.option_strings if o.startswith("--no-")])
            options.append(entry)
    return {"vllm_version": vllm.__version__, "groups": groups, "options": options}


if __name__ == "__main__":
    json.dump(dump(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
