"""Logging for the `vllm-vcr` process: stderr, filtered by a reloadable RUST_LOG-style filter.

`install_reloadable_logging()` (called by the CLI before any subcommand runs) puts one handler on
the root logger and sets levels from `VLLM_VCR_LOG`, else `RUST_LOG`, else the default (`info`).
The control API's `PUT /log` calls `apply_log_filter()` to change them while the process runs.
Code embedding the engine without the CLI never installs this, so `PUT /log` answers 501 there:
a library must not take over its host's logging.

Logs go to stderr so stdout stays pipeable (`inspect ... | jq`).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from .log_filter import (
    OFF,
    TRACE,
    LogFilter,
    LogFilterError,
    LoggingLevels,
    parse_log_filter,
)

__all__ = [
    "TRACE",
    "OFF",
    "LogFilterError",
    "install_reloadable_logging",
    "reloadable_logging_installed",
    "apply_log_filter",
    "current_log_filter",
    "uninstall_reloadable_logging",
]

ENV_VARS = ("VLLM_VCR_LOG", "RUST_LOG")  # the project's own variable wins over the generic one

_LEVEL_LABELS = {TRACE: "TRACE", logging.DEBUG: "DEBUG", logging.INFO: "INFO",
                 logging.WARNING: "WARN", logging.ERROR: "ERROR", logging.CRITICAL: "ERROR"}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (pytest and embedders may swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass


class _TracingFormatter(logging.Formatter):
    """`2026-01-01T12:00:00.123456Z  INFO vllm_vcr::engine: message`, like tracing's fmt layer."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        micros = int((record.created % 1) * 1_000_000)
        label = _LEVEL_LABELS.get(record.levelno, record.levelname)
        target = record.name.replace(".", "::")
        line = f"{ts}.{micros:06d}Z {label:>5} {target}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


_handler: _StderrHandler | None = None
_levels = LoggingLevels()
_saved_root_level: int | None = None


def _initial_filter(default_filter: str) -> tuple[LogFilter, str | None]:
    """Filter from the environment, else the default; a bad env value is reported, not fatal."""
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value is None or not value.strip():
            continue
        try:
            return parse_log_filter(value), None
        except LogFilterError as e:
            return parse_log_filter(default_filter), f"ignoring {var}={value!r}: {e}; using {default_filter!r}"
    return parse_log_filter(default_filter), None


def install_reloadable_logging(default_filter: str = "info") -> None:
    """Install the stderr handler and the filter from VLLM_VCR_LOG / RUST_LOG (idempotent)."""
    global _handler, _saved_root_level
    if _handler is not None:
        return
    flt, warning = _initial_filter(default_filter)
    root = logging.getLogger()
    _saved_root_level = root.level
    handler = _StderrHandler()
    handler.setLevel(logging.NOTSET)  # levels live on the loggers, so PUT /log can lower them
    handler.setFormatter(_TracingFormatter())
    root.addHandler(handler)
    _handler = handler
    _levels.apply(flt)
    logging.captureWarnings(True)
    if warning:
        logging.getLogger("vllm_vcr.logging").warning("%s", warning)


def reloadable_logging_installed() -> bool:
    return _handler is not None


def apply_log_filter(spec: str) -> str:
    """Parse and apply `spec`; returns its canonical form. Raises LogFilterError (unchanged state)."""
    flt = parse_log_filter(spec)
    _levels.apply(flt)
    return flt.to_string()


# vLLM's --log-level names -> the filter's levels
_LOG_LEVELS = {"CRITICAL": "error", "ERROR": "error", "WARNING": "warn", "INFO": "info", "DEBUG": "debug",
               "NOTSET": "trace"}


def apply_log_level(level: str | None) -> None:
    """vLLM's --log-level: the level of every logger (VLLM_VCR_LOG=<level>)."""
    if level and reloadable_logging_installed():
        apply_log_filter(_LOG_LEVELS[level])


def current_log_filter() -> str | None:
    return _levels.current.to_string() if _levels.current else None


def uninstall_reloadable_logging() -> None:
    """Undo install_reloadable_logging (for tests that install it in-process)."""
    global _handler, _saved_root_level
    if _handler is None:
        return
    root = logging.getLogger()
    root.removeHandler(_handler)
    _levels.reset()
    if _saved_root_level is not None:
        root.setLevel(_saved_root_level)
    logging.captureWarnings(False)
    _handler = None
    _saved_root_level = None
