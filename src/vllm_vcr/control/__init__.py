"""The runtime control API (`--control-address`): see docs/control-api.md.

Kept import-light (logging_setup imports log_filter from here); the server loads on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_control_server", "build_control_app", "parse_address", "ControlServer", "ControlAddressError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(name)
