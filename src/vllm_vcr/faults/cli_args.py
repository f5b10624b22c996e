"""`serve` flags for faults by rate (the same names as the PATCH /config fields)."""

from __future__ import annotations

import argparse

from .catalogue import ERROR_KINDS
from .rates import FaultRates
from .rules import FaultSpecError


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("injected HTTP faults (docs/faults.md; also PATCH /config on the control API)")
    g.add_argument("--http-error-rate", type=float, default=0.0, help="fraction of requests answered with an error")
    g.add_argument("--http-error-types", nargs="+", default=["server_error"], metavar="KIND",
                   help=f"errors to draw from: {', '.join(ERROR_KINDS)}")
    g.add_argument("--stream-error-rate", type=float, default=0.0,
                   help="fraction of requests that fail mid-stream with vLLM's error event")
    g.add_argument("--stream-error-after-tokens", type=int, default=1, metavar="K")
    g.add_argument("--stall-rate", type=float, default=0.0, help="fraction of requests whose stream stops for --stall-ms")
    g.add_argument("--stall-ms", type=float, default=1000.0)
    g.add_argument("--stall-after-tokens", type=int, default=0, metavar="K")
    g.add_argument("--reset-rate", type=float, default=0.0, help="fraction of requests whose connection is reset")
    g.add_argument("--reset-after-tokens", type=int, default=1, metavar="K")
    g.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds on injected 429/503")


def rates_from_args(args: argparse.Namespace) -> FaultRates:
    """The flags as FaultRates; FaultSpecError names the bad flag."""
    values = {name: getattr(args, name) for name in FaultRates.__struct_fields__ if hasattr(args, name)}
    try:
        return FaultRates(**values).validate()
    except FaultSpecError as e:
        name = str(e).split(" ", 1)[0]
        raise FaultSpecError(f"--{name.replace('_', '-')}: {e}") from None
