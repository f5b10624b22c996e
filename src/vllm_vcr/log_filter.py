"""RUST_LOG / tracing `EnvFilter` directives, mapped onto Python logging.

Syntax (comma-separated directives, whitespace around them ignored):

    level                  the default for every target no other directive names
    target=level           `target` and everything below it
    target                 same as `target=trace`

Levels are `trace`, `debug`, `info`, `warn`, `error`, `off` (case-insensitive) or the digits
`0`-`5` (`0` = off ... `5` = trace), as in tracing. A target is a module path such as
`vllm_vcr::engine`; `::` maps to Python's `.` (`vllm_vcr::engine` is the `vllm_vcr.engine`
logger), and `.` is accepted too. The longest (most specific) target wins, a later directive for
the same target replaces an earlier one, and a filter without a bare level turns every other target
off, as EnvFilter does. Span and field filters (`target[span{field=value}]=level`) have no Python
counterpart and are rejected rather than silently ignored.
"""

from __future__ import annotations

import logging
import re

import msgspec

TRACE = 5  # below DEBUG, as tracing's TRACE is below DEBUG (uvicorn uses the same number)
OFF = logging.CRITICAL + 10  # above every level Python emits

logging.addLevelName(TRACE, "TRACE")

LEVELS: dict[str, int] = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "off": OFF,
}
_DIGITS = {"0": "off", "1": "error", "2": "warn", "3": "info", "4": "debug", "5": "trace"}
_LEVEL_NAMES = {v: k for k, v in LEVELS.items()}

# A target is a Rust-like module path: identifier characters, '-', separated by '::' (or '.').
_TARGET = re.compile(r"^[A-Za-z0-9_\-]+(?:(?:::|\.)[A-Za-z0-9_\-]+)*$")


# Bounds: every target becomes a Python logger that lives as long as the process (logging keeps
# them), and creating many dotted loggers costs time that grows with the number already there.
MAX_FILTER_CHARS = 8192
MAX_TARGETS = 128
MAX_TARGET_CHARS = 256
# Across all filters a process applies: a target naming a logger that does not exist yet creates
# one, and every setLevel clears the level cache of every logger, so the loggers filters create
# are capped; a filter that would create more is refused (targets already created stay usable).
MAX_NEW_LOGGERS = 1024

_created_loggers: set[str] = set()  # process-wide, as the loggers are
_created_parents: set[str] = set()  # the dotted parents of those (logging's placeholders for them)


def _is_new_logger(name: str, existing: dict) -> bool:
    """Whether applying a level to `name` would create a logger that counts against the cap: not
    a logger yet, and not a placeholder for a parent of a logger the process made itself."""
    if name in _created_loggers:
        return False
    entry = existing.get(name)
    return entry is None or (not isinstance(entry, logging.Logger) and name in _created_parents)


class LogFilterError(ValueError):
    """The filter string does not parse (the control API answers 400)."""


class LogFilter(msgspec.Struct, frozen=True):
    """A parsed filter: `default` for unnamed targets, `targets` maps logger name -> level."""

    default: int
    targets: dict[str, int]

    def level_for(self, logger_name: str) -> int:
        """The level a logger would get (most specific matching target, else default)."""
        best, best_len = self.default, -1
        for name, level in self.targets.items():
            if (logger_name == name or logger_name.startswith(name + ".")) and len(name) > best_len:
                best, best_len = level, len(name)
        return best

    def to_string(self) -> str:
        """Canonical EnvFilter form, e.g. `vllm_vcr::engine=trace,info`."""
        parts = [f"{name.replace('.', '::')}={_LEVEL_NAMES[lvl]}" for name, lvl in self.targets.items()]
        parts.append(_LEVEL_NAMES[self.default])
        return ",".join(parts)


def _parse_level(text: str) -> int | None:
    t = text.strip().lower()
    t = _DIGITS.get(t, t)
    return LEVELS.get(t)


def parse_log_filter(spec: str) -> LogFilter:
    """Parse an EnvFilter string; raises LogFilterError naming the bad directive."""
    if not isinstance(spec, str):
        raise LogFilterError("log filter must be a string")
    if len(spec) > MAX_FILTER_CHARS:
        raise LogFilterError(f"log filter is {len(spec)} characters long; at most {MAX_FILTER_CHARS}")
    directives = [d.strip() for d in spec.split(",")]
    directives = [d for d in directives if d]
    if not directives:
        raise LogFilterError("log filter is empty; give a level (e.g. 'info') or target=level directives")
    default: int | None = None
    targets: dict[str, int] = {}
    for d in directives:
        if "[" in d or "{" in d:
            raise LogFilterError(f"unsupported directive {d!r}: span and field filters have no Python counterpart")
        level = _parse_level(d)
        if level is not None and "=" not in d:
            default = level  # a later bare level replaces an earlier one
            continue
        target, sep, level_text = d.partition("=")
        target = target.strip()
        if len(target) > MAX_TARGET_CHARS:
            raise LogFilterError(f"invalid directive: target longer than {MAX_TARGET_CHARS} characters")
        if not _TARGET.match(target):
            raise LogFilterError(f"invalid directive {d!r}: bad target {target!r}")
        if sep:
            level = _parse_level(level_text)
            if level is None:
                raise LogFilterError(
                    f"invalid directive {d!r}: unknown level {level_text.strip()!r} "
                    "(use trace, debug, info, warn, error or off)"
                )
        else:
            level = TRACE  # a bare target enables everything in it, as in EnvFilter
        name = target.replace("::", ".")
        targets.pop(name, None)  # keep insertion order = last writer
        targets[name] = level
        if len(targets) > MAX_TARGETS:
            raise LogFilterError(f"log filter names more than {MAX_TARGETS} targets")
    return LogFilter(default=OFF if default is None else default, targets=targets)


def _set_level(logger: logging.Logger, level: int) -> None:
    if logger.level != level:
        logger.setLevel(level)


class LoggingLevels:
    """Applies LogFilters to the logging module, undoing the previous filter's target levels."""

    def __init__(self) -> None:
        self._touched: set[str] = set()
        self.current: LogFilter | None = None

    def apply(self, flt: LogFilter) -> None:
        """Raises LogFilterError (nothing applied) when the filter would create a logger beyond
        MAX_NEW_LOGGERS."""
        existing = logging.Logger.manager.loggerDict
        new = [name for name in flt.targets if _is_new_logger(name, existing)]
        if new and len(_created_loggers) + len(new) > MAX_NEW_LOGGERS:
            raise LogFilterError(
                f"log filter names {len(new)} target(s) no logger exists for ({new[0]!r}, ...); this process "
                f"has already created {len(_created_loggers)} such loggers and creates at most "
                f"{MAX_NEW_LOGGERS} (Python keeps them for the life of the process)")
        _created_loggers.update(new)
        for name in new:
            parts = name.split(".")
            _created_parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
        # Python loggers inherit their parent's level when NOTSET, which gives EnvFilter's
        # "most specific target wins" at module boundaries without a per-record filter.
        # Each setLevel clears every logger's cache, so only the levels that change are set.
        for name in self._touched - set(flt.targets):
            _set_level(logging.getLogger(name), logging.NOTSET)
        for name, level in flt.targets.items():
            _set_level(logging.getLogger(name), level)
        _set_level(logging.getLogger(), flt.default)
        self._touched = set(flt.targets)
        self.current = flt

    def reset(self) -> None:
        for name in self._touched:
            logging.getLogger(name).setLevel(logging.NOTSET)
        self._touched = set()
        self.current = None
