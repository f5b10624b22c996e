"""Fault scripts: an ordered list of rules, each a match, an action, a count and an expiry.

The first live rule that matches a request decides its fault and uses up one of its count; a
rule whose count is spent or whose time is up is gone. "Fail the next 5 with 429, then recover"
is one rule: `{"action": "http_error", "error": "rate_limit", "count": 5}`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import re

import msgspec

from .catalogue import ERROR_KINDS, HTTPFailure, failure_for_kind, failure_for_status

ActionName = Literal["http_error", "stream_error", "stall", "reset"]
ACTIONS: tuple[str, ...] = ("http_error", "stream_error", "stall", "reset")
MAX_RULES = 256

# RFC 9110: a field name is a token; a field value is visible ASCII, obs-text (0x80-0xFF), spaces
# and tabs inside, none at either end (a server strips them, so such a value could never match).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"(?:[\x21-\x7e\x80-\xff](?:[\x20\x09\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")


class FaultSpecError(ValueError):
    """A rule or rate that cannot be used (the control API answers 400)."""


class FaultSchemaError(FaultSpecError):
    """The body does not match the schema (the control API answers 422)."""


class Match(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Every field given must match; an empty match matches every generation request."""

    path: str | None = None  # exact, or a prefix ending in "*"
    model: str | None = None
    header: dict[str, str] | None = None  # name -> value ("*": present with any value)
    request_index: list[int] | None = None  # [first, last], 0-based, counted from when the script was set

    def matches(self, info: RequestInfo, index: int) -> bool:
        if self.path is not None:
            if self.path.endswith("*"):
                if not info.path.startswith(self.path[:-1]):
                    return False
            elif info.path != self.path:
                return False
        if self.request_index is not None and not self.request_index[0] <= index <= self.request_index[1]:
            return False
        if self.header:
            for name, want in self.header.items():
                got = info.headers.get(name.lower().encode("latin-1"))
                if got is None or (want != "*" and got.decode("latin-1") != want):
                    return False
        if self.model is not None and info.model() != self.model:
            return False
        return True


class Rule(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    action: ActionName
    match: Match = msgspec.field(default_factory=Match)
    error: str | int | None = None  # http_error: a kind (rate_limit, ...) or a 4xx/5xx status
    after_tokens: int = 0  # stream_error/stall/reset: token chunks sent before the fault
    stall_ms: float = 0.0  # stall: how long the stream stops
    retry_after: float | None = None  # seconds, for 429/503 (default 1)
    count: int | None = None  # None: every match until it expires
    expires_in: float | None = None  # seconds after the script was set

    def validate(self) -> Rule:
        if self.action == "http_error":
            if self.error is None:
                raise FaultSpecError("an http_error rule needs `error`: one of "
                                     f"{', '.join(ERROR_KINDS)} or a status 400-599")
            if isinstance(self.error, str) and self.error not in ERROR_KINDS:
                raise FaultSpecError(f"unknown error {self.error!r}; one of {', '.join(ERROR_KINDS)} "
                                     "or a status 400-599")
            if isinstance(self.error, int) and not 400 <= self.error <= 599:
                raise FaultSpecError(f"error status must be 400-599, got {self.error}")
        if self.after_tokens < 0 or self.stall_ms < 0 or (self.retry_after is not None and self.retry_after < 0):
            raise FaultSpecError("after_tokens, stall_ms and retry_after must not be negative")
        if self.action == "stall" and self.stall_ms <= 0:
            raise FaultSpecError("a stall rule needs stall_ms > 0")
        if self.count is not None and self.count < 1:
            raise FaultSpecError("count must be at least 1 (leave it out for no limit)")
        if self.expires_in is not None and self.expires_in <= 0:
            raise FaultSpecError("expires_in must be > 0 seconds")
        for name, value in (self.match.header or {}).items():
            if not _TOKEN.fullmatch(name):
                raise FaultSpecError(f"match.header name {name!r} is not an HTTP header name "
                                     "(letters, digits and !#$%&'*+-.^_`|~ only)")
            if not _FIELD_VALUE.fullmatch(value):
                raise FaultSpecError(f"match.header value {value!r} for {name!r} is not one HTTP can carry "
                                     "(latin-1 printable characters, no control characters, no surrounding spaces)")
        idx = self.match.request_index
        if idx is not None and (len(idx) != 2 or idx[0] < 0 or idx[1] < idx[0]):
            raise FaultSpecError("match.request_index must be [first, last] with 0 <= first <= last")
        return self


class ScriptSpec(msgspec.Struct, forbid_unknown_fields=True):
    rules: list[Rule]


@dataclass
class RequestInfo:
    """What a rule can look at. `model` is read from the body only when a rule asks for it."""

    path: str
    headers: Mapping[bytes, bytes]
    model: Callable[[], str | None]


@dataclass
class FaultAction:
    action: str
    source: str  # "script", "rate" or "header"
    failure: HTTPFailure | None = None
    after_tokens: int = 0
    stall_ms: float = 0.0


def action_of(rule: Rule, *, model: str, max_model_len: int, source: str = "script") -> FaultAction:
    failure = None
    if rule.action == "http_error":
        if isinstance(rule.error, int):
            failure = failure_for_status(rule.error, retry_after=rule.retry_after,
                                         reason=f"Simulated error injected by vllm-vcr (code {rule.error})")
        else:
            failure = failure_for_kind(str(rule.error), model=model, max_model_len=max_model_len,
                                       retry_after=rule.retry_after)
    return FaultAction(rule.action, source, failure, rule.after_tokens, rule.stall_ms)


class _LiveRule:
    __slots__ = ("rule", "remaining", "deadline", "used")

    def __init__(self, rule: Rule, now: float) -> None:
        self.rule = rule
        self.remaining = rule.count
        self.deadline = None if rule.expires_in is None else now + rule.expires_in
        self.used = 0


class FaultScript:
    """The installed rules and the count of requests seen since they were set."""

    def __init__(self, rules: list[Rule], now: float) -> None:
        if len(rules) > MAX_RULES:
            raise FaultSpecError(f"at most {MAX_RULES} rules")
        self._live = [_LiveRule(r.validate(), now) for r in rules]
        self.requests_seen = 0

    def __bool__(self) -> bool:
        return bool(self._live)

    def pick(self, info: RequestInfo, now: float) -> Rule | None:
        """The rule for this request (using one of its count), or None."""
        index = self.requests_seen
        self.requests_seen += 1
        self._live = [lr for lr in self._live if lr.deadline is None or now < lr.deadline]
        for lr in self._live:
            if lr.rule.match.matches(info, index):
                lr.used += 1
                if lr.remaining is not None:
                    lr.remaining -= 1
                    if lr.remaining <= 0:
                        self._live.remove(lr)
                return lr.rule
        return None

    def to_state(self) -> dict:
        """Everything the script is, as plain data (faults/shared.py keeps it in a file)."""
        return {"seen": self.requests_seen,
                "live": [[msgspec.to_builtins(lr.rule), lr.remaining, lr.deadline, lr.used] for lr in self._live]}

    @classmethod
    def from_state(cls, state: dict) -> FaultScript:
        script = cls([], 0.0)
        script.requests_seen = state["seen"]
        for rule, remaining, deadline, used in state["live"]:
            lr = _LiveRule(msgspec.convert(rule, Rule), 0.0)
            lr.remaining, lr.deadline, lr.used = remaining, deadline, used
            script._live.append(lr)
        return script

    def describe(self, now: float) -> list[dict]:
        out = []
        for lr in self._live:
            if lr.deadline is not None and now >= lr.deadline:
                continue
            d = msgspec.to_builtins(lr.rule)
            d.pop("count", None)
            d.pop("expires_in", None)
            d["remaining"] = lr.remaining
            d["expires_in"] = None if lr.deadline is None else round(lr.deadline - now, 3)
            d["used"] = lr.used
            out.append(d)
        return out
