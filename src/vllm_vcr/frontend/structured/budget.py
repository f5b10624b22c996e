"""The time and memory budgets of structured outputs.

Checking a constraint (`checked_constraint`: compiling the grammar, regex or schema as vLLM's
backends would) and writing each output for it (`generated_text`) run in `POOL`'s worker
processes (frontend/isolated.py), at most `COMPILE_TIMEOUT` and `GENERATE_TIMEOUT` seconds each
(vLLM's `VLLM_REGEX_COMPILATION_TIMEOUT_S` is 5 s) and `POOL.memory_mb` MiB; a worker over its
budget is killed, as it is when the request's client leaves or the server stops. The size
budget (sizes.py) is checked first. Over a budget the request fails with a 400 BadRequestError
worded as vLLM's xgrammar backend words a constraint it cannot compile (param null, as there):
for a regex, vLLM's own timeout message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..isolated import BudgetExceeded, IsolatedPool
from ..protocol import RequestValueError
from .constraints import check_request_constraints, request_constraint
from .sizes import KIND_NAMES, check_sizes, too_large

COMPILE_TIMEOUT = 5.0
GENERATE_TIMEOUT = 5.0

# imported once in the forkserver, so that a fresh worker starts warm
_PRELOAD = ["vllm_vcr.frontend.chat_outputs", "hypothesis", "hypothesis.extra.lark", "hypothesis_jsonschema",
            "jsonschema", "lark", "llguidance"]
POOL = IsolatedPool(workers=2, memory_mb=1024, recycle_mb=256, preload=_PRELOAD)


def over_time(kind: str, value: Any, seconds: float, step: str) -> RequestValueError:
    if kind == "regex" and step == "compile":  # vLLM's own words (compile_regex_with_timeout)
        return too_large(kind, f"Regex compilation timed out after {seconds:g}s. The pattern may be too complex "
                               "or contain constructs that cause exponential state-space explosion (e.g. nested "
                               f"quantifiers). Pattern: {str(value)[:200]}")
    doing = "compilation" if step == "compile" else "generating an output"
    return too_large(kind, f"{doing} timed out after {seconds:g}s; the {KIND_NAMES.get(kind, kind)} is too "
                           "complex for this server")


def over_memory(kind: str, step: str) -> RequestValueError:
    doing = "compilation" if step == "compile" else "generating an output"
    return too_large(kind, f"{doing} needed more than {POOL.memory_mb} MiB; the {KIND_NAMES.get(kind, kind)} is "
                           "too complex for this server")


async def _bounded(kind: str, value: Any, step: str, timeout: float, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return await POOL.run(fn, *args, timeout=timeout)
    except BudgetExceeded as e:
        if e.reason == "memory":
            raise over_memory(kind, step) from None
        raise over_time(kind, value, timeout, step) from None


async def checked_constraint(response_format: Any, structured_outputs: Any) -> Any:
    """`constraints.request_constraint` within the budgets (the Constraint, or None)."""
    check_sizes(response_format, structured_outputs)
    kind, value = _compiled_kind(response_format, structured_outputs)
    if kind is None:  # nothing to compile (a choice list, json_object): no worker needed
        return request_constraint(response_format, structured_outputs)
    return await _bounded(kind, value, "compile", COMPILE_TIMEOUT, request_constraint, response_format,
                          structured_outputs)


async def checked_request_constraints(body: Any, tool_choice: Any, *, completion: bool = False) -> None:
    """`constraints.check_request_constraints` (the request model's checks) within the budgets: a
    structural tag's grammars and schemas are compiled in a worker, the rest is checked here."""
    rf = body.get("response_format") if isinstance(body, dict) else getattr(body, "response_format", None)
    so = body.get("structured_outputs") if isinstance(body, dict) else getattr(body, "structured_outputs", None)
    check_sizes(rf, so)
    tagged = (isinstance(rf, dict) and rf.get("type") == "structural_tag") or \
        (isinstance(so, dict) and so.get("structural_tag") is not None)
    if not tagged:
        check_request_constraints(body, tool_choice, completion=completion)
        return
    await _bounded("structural_tag", None, "compile", COMPILE_TIMEOUT,
                   functools.partial(check_request_constraints, completion=completion),
                   {"response_format": rf, "structured_outputs": so}, tool_choice)


async def generated_text(kind: str, value: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` (a module-level function writing an output) within the generation budget."""
    return await _bounded(kind, value, "generate", GENERATE_TIMEOUT, fn, *args)


def _compiled_kind(response_format: Any, structured_outputs: Any) -> tuple[str | None, Any]:
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "structural_tag"):
        return ("json" if response_format["type"] == "json_schema" else "structural_tag"), response_format
    if isinstance(structured_outputs, dict):
        for kind in ("json", "regex", "grammar", "structural_tag"):
            if structured_outputs.get(kind) is not None:
                return kind, structured_outputs[kind]
    return None, None
