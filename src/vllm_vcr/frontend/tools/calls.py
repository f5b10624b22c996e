"""Tool-call requests as vLLM 0.32 checks them, what the simulated model calls, and reading the
calls back out of the generated text.

The simulated model decides like a model would: `tool_choice` "required" or a named function
always calls; "auto" calls with the configured probability; "none" never does. The arguments are
an instance of the tool's `parameters` schema, drawn deterministically from the request seed.
The calls are written in the --tool-call-parser's own format (or the JSON vLLM constrains
"required"/named choices to, for parsers that read JSON there), so what the frontend parses back
is whatever the engine actually produced: a response replay table's recorded calls included.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from ..protocol import RequestValueError
from ..structured.instances import dump_json, json_instance
from .formats import ParsedCall, ToolCallFormat

_EMPTY_PARAMS = {"type": "object", "properties": {}}
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


# the --tool-call-parser formats simulated tool calls are written in and parsed from
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic")


@dataclass(frozen=True)
class ToolSettings:
    """--enable-auto-tool-choice, --tool-call-parser and how often "auto" calls a tool."""

    parser: str | None = None
    enable_auto: bool = False
    auto_call_probability: float = 1.0

    @property
    def available(self) -> bool:
        return self.enable_auto and self.parser is not None


def effective_tool_choice(body_has_tool_choice: bool, tools: list | None, tool_choice: Any) -> Any:
    """vLLM: tools without a tool_choice mean "auto"."""
    if not body_has_tool_choice and tools:
        return "auto"
    return tool_choice


def check_tool_usage(tools: list | None, tool_choice: Any, body_has_tool_choice: bool) -> None:
    """ChatCompletionRequest.check_tool_usage: the request model's own validator."""
    if tools == []:
        raise RequestValueError("`tools` must not be an empty array. Either provide at least one tool or omit the "
                                "field entirely.", "tools")
    if tool_choice == "none" or tool_choice is None or not body_has_tool_choice and not tools:
        return
    if tools is None:
        raise RequestValueError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice not in ("auto", "required") and not isinstance(tool_choice, dict):
        raise RequestValueError(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, \"none\", "
                                "\"auto\" or \"required\" are supported.", "tool_choice")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if not isinstance(function, dict):
            raise RequestValueError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}",
                                    "tool_choice.function")
        if "name" not in function:
            raise RequestValueError(f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
                                    "tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise RequestValueError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}",
                                    "tool_choice.function.name")
        if not any(tool_name(t) == name for t in tools):
            raise RequestValueError("The tool specified in `tool_choice` does not match any of the specified "
                                    "`tools`", "tool_choice")


def check_tool_gates(tool_choice: Any, settings: ToolSettings) -> None:
    """The renderer's check: tool calls need a tool parser (and "auto" the flag as well)."""
    if settings.available or tool_choice in (None, "none"):
        return
    if tool_choice == "auto" and not settings.enable_auto:
        raise RequestValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                "to be set")
    if tool_choice != "auto":
        desc = (f'function "{tool_choice["function"]["name"]}"' if isinstance(tool_choice, dict)
                else f'"{tool_choice}"')
        raise RequestValueError(f"tool_choice={desc} requires --tool-call-parser to be set")


def tool_name(tool: Any) -> str | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def named_choice(tool_choice: Any) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def plan_calls(tools: list[dict], tool_choice: Any, parallel: bool | None, seed: int,
               settings: ToolSettings) -> list[tuple[str, Any]]:
    """The calls the simulated model makes (empty: it answers in text)."""
    rng = random.Random(seed)
    named = named_choice(tool_choice)
    if named is not None:
        chosen = [next(t for t in tools if tool_name(t) == named)]
    elif tool_choice == "required" or (tool_choice == "auto" and rng.random() < settings.auto_call_probability):
        count = 1 if parallel is False or len(tools) == 1 else rng.choice((1, 1, 2))
        chosen = [tools[rng.randrange(len(tools))] for _ in range(count)]
    else:
        return []
    calls = []
    for k, tool in enumerate(chosen):
        params = tool["function"].get("parameters") or _EMPTY_PARAMS
        calls.append((tool_name(tool), json_instance(params, seed * 31 + k)))
    return calls


def render_calls(fmt: ToolCallFormat, calls: list[tuple[str, Any]], tool_choice: Any) -> str:
    """The text the model writes for its calls (JSON where vLLM constrains forced calls to JSON)."""
    if fmt.json_for_forced and named_choice(tool_choice) is not None:
        return dump_json(calls[0][1])
    if fmt.json_for_forced and tool_choice == "required":
        return dump_json([{"name": n, "parameters": a} for n, a in calls])
    return fmt.render(calls)


def extract_calls(fmt: ToolCallFormat, text: str, tool_choice: Any) -> tuple[str | None, list[ParsedCall]] | None:
    """(content, calls) as vLLM's parser extracts them; None when tool parsing does not apply."""
    if tool_choice in (None, "none"):
        return None
    named = named_choice(tool_choice)
    if fmt.json_for_forced and named is not None:
        return (None, []) if not text.strip() else (None, [ParsedCall(named, text)])
    if fmt.json_for_forced and tool_choice == "required":
        try:
            items = json.loads(text or "")
            calls = [ParsedCall(c["name"], dump_json(c["parameters"])) for c in items]
        except (ValueError, KeyError, TypeError):
            calls = []
        return None, calls
    content, calls = fmt.parse(text)
    if content is not None and not content.strip() and calls:
        content = None
    if not calls and tool_choice != "auto" and not (content or "").strip():
        return None, []
    return content, calls


