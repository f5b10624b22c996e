"""The runtime control API (`--control-address`): see docs/control-api.md."""

from .server import ControlAddressError, ControlServer, build_control_app, parse_address, start_control_server

__all__ = ["start_control_server", "build_control_app", "parse_address", "ControlServer", "ControlAddressError"]
