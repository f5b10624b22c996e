"""`vllm serve` flags that mean nothing without a GPU or a model: the parser (cli.py) stores each
under a dest with this prefix, and start-up reports them in one log line."""

from __future__ import annotations

import argparse
import json

IGNORED_DEST_PREFIX = "ignored__"


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The ignored flags given on the command line, as they were written (`--x`, `--no-x`, `--x=v`)."""
    out = []
    for key, value in sorted(vars(args).items()):
        if key.startswith(IGNORED_DEST_PREFIX):
            flag = "--" + key[len(IGNORED_DEST_PREFIX):].replace("_", "-")
            if isinstance(value, (dict, list)):
                value = json.dumps(value, separators=(",", ":"))
            out.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag}={value}")
    return out
