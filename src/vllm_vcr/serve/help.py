"""`vllm-vcr serve`'s parser: vLLM's command-line conventions and a help that fits a screen.

- `--help` shows what a user needs first (the FIRST_SCREEN options) and the option groups;
  `--help=all` everything, `--help=<group>` one group (case-insensitive, `-`/`_`/space alike),
  `--help=<text>` every option whose name contains the text, `--help=ignored` the options
  accepted and ignored (vLLM's FlexibleArgumentParser has the same `--help=` forms).
- `--max_num_seqs` is `--max-num-seqs`; `--compilation-config.mode 3` and
  `--x.list+ a,b` build the JSON value of `--x`; `-O3` is `--optimization-level 3` (vLLM's forms).
- an argument error is one line naming the flag, with a hint (the closest flag, the help to read).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from typing import Any, NoReturn

from .vllm_args import _human_readable_int

TIP = ("For all options: --help=all   a group: --help=<group>   a flag: --help=max-model-len   "
       "accepted but ignored: --help=ignored")


def _norm(text: str) -> str:
    return re.sub(r"[\s_\-]+", "", text.lower())


class _Formatter(argparse.HelpFormatter):
    """Shows a default only when there is one (no `(default: None)`)."""

    def __init__(self, prog: str, **kwargs: Any):
        kwargs.setdefault("max_help_position", 32)
        super().__init__(prog, **kwargs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not action.option_strings:
            return text
        d = action.default
        if d is None or d is argparse.SUPPRESS or d == [] or getattr(action, "ignored", False):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class ServeParser(argparse.ArgumentParser):
    """The `serve` subcommand's parser (see the module docstring)."""

    def __init__(self, *args: Any, first_screen: tuple[str, ...] = (), **kwargs: Any):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.first_screen = first_screen
        self.search_keyword: str | None = None

    @classmethod
    def add_to(cls, subparsers: Any, name: str, **kwargs: Any) -> ServeParser:
        saved = subparsers._parser_class
        subparsers._parser_class = cls
        try:
            return subparsers.add_parser(name, usage="%(prog)s [MODEL] [options]", **kwargs)
        finally:
            subparsers._parser_class = saved

    # --- errors -------------------------------------------------------------------------------
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self.hint(message)}\n")

    def hint(self, message: str) -> str:
        m = re.match(r"argument ([^:/ ]+)", message)
        if m:
            return f" (see: {self.prog} --help={m.group(1).lstrip('-')})"
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m and m.group(1).startswith("-"):
            flag = m.group(1).split("=", 1)[0]
            close = difflib.get_close_matches(flag, list(self._option_string_actions), n=1, cutoff=0.75)
            if close:
                return f" (did you mean {close[0]}? see: {self.prog} --help={close[0].lstrip('-')})"
            return f" (see: {self.prog} --help=all)"
        return f" (see: {self.prog} --help)"

    # --- vLLM's argument forms --------------------------------------------------------------
    def normalise(self, args: list[str]) -> list[str]:
        """vLLM's spellings turned into plain argparse ones (`--help=x` remembered for format_help)."""
        out: list[str] = []
        dicts: dict[str, Any] = {}
        skip = False
        for i, arg in enumerate(args):
            if skip:
                skip = False
                continue
            if arg.startswith("--help="):
                self.search_keyword = arg.split("=", 1)[1]
                out.append("--help")
                continue
            if arg.startswith("-O") and arg != "-O" and not arg.startswith("--"):
                out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
                continue
            if arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
                out.append("--optimization-level")
                continue
            if not arg.startswith("--") or arg == "--":
                out.append(arg)
                continue
            key, eq, value = arg.partition("=")
            head, dot, rest = key[2:].partition(".")
            key = "--" + head.replace("_", "-") + dot + rest
            if dot:  # --json-arg.key value: one JSON value per option
                if not eq:
                    if i + 1 >= len(args):
                        self.error(f"argument {key}: expected one argument")
                    value, skip = args[i + 1], True
                path = rest.split(".")
                if path[-1].endswith("+"):
                    path[-1] = path[-1][:-1]
                    parsed: Any = value.split(",")
                else:
                    parsed = _dotted_value(value)
                node = dicts.setdefault("--" + head.replace("_", "-"), {})
                for p in path[:-1]:
                    node = node.setdefault(p, {})
                if isinstance(parsed, list) and isinstance(node.get(path[-1]), list):
                    node[path[-1]] += parsed
                else:
                    node[path[-1]] = parsed
                continue
            out.append(key + eq + value if eq else key)
        for flag, value in dicts.items():
            out += [flag, json.dumps(value)]
        return out

    # --- help ------------------------------------------------------------------------------------
    def format_help(self) -> str:
        keyword = self.search_keyword
        if keyword is None:
            return self._first_screen()
        kw = keyword.lower().replace("_", "-")
        if kw == "all":
            return super().format_help() + "\n" + TIP + "\n"
        groups = [g for g in self._action_groups if _visible(g._group_actions)]
        if kw == "ignored":
            actions = [a for g in groups for a in g._group_actions if getattr(a, "ignored", False)]
            return self._section("Options of `vllm serve` accepted and ignored", actions)
        for g in groups:
            if g.title and (_norm(g.title) == _norm(kw) or _norm(g.title.split("(")[0]) == _norm(kw)):
                return self._section(g.title, _visible(g._group_actions), g.description)
        matched = [a for g in groups for a in _visible(g._group_actions)
                   if any(kw in o.lower() for o in a.option_strings)]
        if matched:
            return self._section(f"Arguments matching '{kw}'", matched)
        return (f"No group or arguments matching '{kw}'.\n"
                "Use '--help' to see available groups or '--help=all' to see all available parameters.\n")

    def _section(self, title: str, actions: list[argparse.Action], description: str | None = None) -> str:
        f = self._get_formatter()
        f.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        f.start_section(title)
        f.add_text(description)
        f.add_arguments(actions)
        f.end_section()
        return f.format_help()

    def _first_screen(self) -> str:
        f = self._get_formatter()
        f.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        f.add_text(self.description)
        first = [a for a in self._actions if not a.option_strings and a.help != argparse.SUPPRESS]
        first += [self._option_string_actions[o] for o in self.first_screen if o in self._option_string_actions]
        f.start_section("Start here")
        f.add_arguments(first)
        f.end_section()
        lines = []
        for g in self._action_groups:
            actions = _visible(g._group_actions)
            if not actions or g.title == "positional arguments":
                continue
            ignored = sum(1 for a in actions if getattr(a, "ignored", False))
            count = f"{len(actions)} options" + (f", {ignored} accepted and ignored" if ignored else "")
            lines.append(f"  {_short(g.title):<{self._title_width()}} {count}")
        return f.format_help() + "\nOption groups (--help=<group>):\n" + "\n".join(lines) + "\n\n" + TIP + "\n"

    def _title_width(self) -> int:
        return max(len(_short(g.title)) for g in self._action_groups) + 1

    def print_help(self, file: Any = None) -> None:
        self._print_message(self.format_help(), file or sys.stdout)


def _short(title: str | None) -> str:
    """A group's title without its parenthesised note (what --help=<group> matches)."""
    return (title or "").split(" (")[0]


def _visible(actions: list[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def _dotted_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        try:
            return _human_readable_int(text)
        except (ValueError, argparse.ArgumentTypeError):
            return text
