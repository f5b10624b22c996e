"""The `vllm-vcr` command. Each subcommand lives with the adapter it starts."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "serve": "vllm_vcr.serve.cli",
    "play": "vllm_vcr.wire.cli",
    "record": "vllm_vcr.record.cli",
    "inspect": "vllm_vcr.inspect.cli",
    "replay-arrivals": "vllm_vcr.replay.cli",
    "pd-proxy": "vllm_vcr.pd.cli",
    "simulate": "vllm_vcr.simulate.cli",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = argparse.ArgumentParser(prog="vllm-vcr", description="A GPU-free stand-in for a vLLM engine.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"vllm-vcr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules: dict[str, object] = {}
    for name, mod_name in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("vllm_vcr"):
                continue  # subcommand not built yet
            raise
        mod.add_parser(sub)
        modules[name] = mod
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"] and "serve" in modules:  # vLLM's --config file.yaml
        argv = modules["serve"].expand_argv(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    from .logging_setup import install_reloadable_logging

    install_reloadable_logging()
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
