"""The `vllm-vcr` command. Each subcommand lives with the adapter it starts.

A subcommand whose module fails to import stays in the command: `vllm-vcr --help` lists it as
unavailable with the reason, and running it exits 1 with one line naming the subcommand, its
module and the error (and the extra to install when the missing module comes from one).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "serve": "vllm_vcr.serve.cli",
    "play": "vllm_vcr.wire.cli",
    "record": "vllm_vcr.record.cli",
    "inspect": "vllm_vcr.inspect.cli",
    "replay-arrivals": "vllm_vcr.replay.cli",
    "pd-proxy": "vllm_vcr.pd.cli",
    "simulate": "vllm_vcr.simulate.cli",
    "fleet": "vllm_vcr.fleet.cli",
}

# top-level module -> the optional extra that installs it (pyproject.toml [project.optional-dependencies];
# tests/test_cli_entry.py holds the two together)
EXTRAS = {
    "aiconfigurator_core": "aic",
    "matplotlib": "plot",
    "xxhash": "xxhash",
}

UNAVAILABLE_EXIT = 1


@dataclass(frozen=True)
class Unavailable:
    """A subcommand whose module raised while being imported."""

    module: str
    error: Exception

    def reason(self) -> str:
        """`Type: message`, plus the extra to install or, for an error that is not a missing
        module, where it was raised."""
        e = self.error
        text = f"{type(e).__name__}: {e}"
        if isinstance(e, ModuleNotFoundError):
            top = (e.name or "").partition(".")[0]
            extra = EXTRAS.get(top)
            if extra and e.name == top:
                text += f" (the {extra!r} extra provides it: pip install 'vllm-vcr[{extra}]')"
            elif extra:  # the package is there (a missing parent is what would be reported) but older
                text += f" (from the {extra!r} extra, installed without it: pip install -U 'vllm-vcr[{extra}]')"
            return text
        where = _raised_at(e)
        return f"{text} (at {where})" if where else text

    def message(self, command: str) -> str:
        return f"vllm-vcr: error: the {command!r} subcommand is unavailable: {self.module} failed to import: " \
               f"{self.reason()}"


def _raised_at(e: BaseException) -> str | None:
    """file:line of the innermost frame of e's traceback that is not the import machinery."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{_short(e.filename)}:{e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen ")]
    return f"{_short(frames[-1].filename)}:{frames[-1].lineno}" if frames else None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def load_subcommands(names=None) -> tuple[dict[str, ModuleType], dict[str, Unavailable]]:
    """Import the subcommands' modules (all, or those in `names`): (the ones that loaded, the ones
    that did not and why)."""
    loaded: dict[str, ModuleType] = {}
    unavailable: dict[str, Unavailable] = {}
    for name, mod_name in SUBCOMMANDS.items():
        if names is not None and name not in names:
            continue
        try:
            loaded[name] = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001 - any failure at import time makes the subcommand unavailable
            unavailable[name] = Unavailable(mod_name, e)
    return loaded, unavailable


def _build(loaded: dict[str, ModuleType], unavailable: dict[str, Unavailable]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-vcr", description="A GPU-free stand-in for a vLLM engine.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"vllm-vcr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:  # in the table's order, loaded or not
        if name not in loaded and name not in unavailable:  # not asked for (main: another subcommand runs)
            continue
        if name in loaded:
            loaded[name].add_parser(sub)
        else:  # no flags of its own: main() reports why before anything else is parsed
            reason = unavailable[name].reason().replace("%", "%%")  # argparse %-formats help strings
            sub.add_parser(name, add_help=False, help=f"UNAVAILABLE: {reason}")
    return parser


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    """The parser and the modules of the subcommands that loaded (the others are listed unavailable)."""
    loaded, unavailable = load_subcommands()
    return _build(loaded, unavailable), loaded


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `vllm-vcr SUBCOMMAND ...` imports that subcommand's module only (start-up time: the others pull in
    # numpy, pydantic, the HTTP stack); anything else (`--help`, `--version`, a typo) builds the whole table
    only = {argv[0]} if argv[:1] and argv[0] in SUBCOMMANDS else None
    loaded, unavailable = load_subcommands(only)
    parser = _build(loaded, unavailable)
    if argv[:1] == ["serve"] and "serve" in loaded:  # vLLM's --config file.yaml
        argv = loaded["serve"].expand_argv(argv)
    args, rest = parser.parse_known_args(argv)
    if args.command in unavailable:  # whatever flags follow: the module that would read them is not there
        print(unavailable[args.command].message(args.command), file=sys.stderr)
        return UNAVAILABLE_EXIT
    if rest:  # as parse_args would (a subcommand's own parser words its errors)
        (getattr(args, "_serve_parser", None) or parser).error("unrecognized arguments: " + " ".join(rest))
    if not args.command:
        parser.print_help()
        return 2
    from .logging_setup import install_reloadable_logging

    install_reloadable_logging()
    return int(loaded[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
