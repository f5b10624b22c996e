"""Tool calls a model behind the real frontend writes when nothing constrains it (`play`).

For tool_choice "auto" (and, for parsers that read their own format, "required" and named) the
frontend sends no constraint: the model decides from its prompt. The chat template has written
the tool definitions into the prompt in the model family's own way; this reads them back, picks
one (deterministically for the seed) and writes a call with schema-valid arguments in that
family's output format:

- Mistral (`[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`): `[TOOL_CALLS] [{"name", "arguments"}]`,
  or `[TOOL_CALLS]name[ARGS]{...}` when the tokenizer has `[ARGS]` (v11 and later);
- Hermes (`<tools>...</tools>`): `<tool_call>{...}</tool_call>`;
- Llama 3.1 (a tokenizer with `<|python_tag|>`): `{"name": ..., "parameters": {...}}`.

A prompt whose last turn is a tool result gets no call: the model answers in text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..structured.instances import dump_json
from .calls import ToolSettings, plan_calls
from .formats import HermesFormat, Llama3JsonFormat, MistralFormat

_MAX_SCANNED_OBJECTS = 512  # bounds the scan of a long prompt full of braces
_TOOL_RESULT_MARKERS = ("[/TOOL_RESULTS]", "<|start_header_id|>ipython<|end_header_id|>", "</tool_response>")


def _is_tool(obj: Any) -> bool:
    fn = obj.get("function") if isinstance(obj, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and obj.get("type", "function") == "function"


def prompt_tools(text: str) -> list[dict[str, Any]]:
    """Every tool definition ({"type": "function", "function": {...}}) written in the prompt."""
    decoder = json.JSONDecoder()
    tools: list[dict[str, Any]] = []
    seen, end = 0, -1
    for pos in (i for i, c in enumerate(text) if c in "[{"):
        if pos < end:
            continue
        seen += 1
        if seen > _MAX_SCANNED_OBJECTS:
            break
        try:
            obj, n = decoder.raw_decode(text, pos)
        except ValueError:
            continue
        found = [o for o in (obj if isinstance(obj, list) else [obj]) if _is_tool(o)]
        if found:
            tools += found
            end = n
    return tools


def prompt_tool_schemas(text: str) -> dict[str, Any]:
    """{tool name: parameters schema} of the tools written in the prompt."""
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
            for t in prompt_tools(text)}


def _family(text: str, vocab: dict[str, int]) -> str | None:
    if "[AVAILABLE_TOOLS]" in text and "[TOOL_CALLS]" in vocab:
        return "mistral" if "[ARGS]" in vocab else "mistral_pre_v11"
    if "<tools>" in text:
        return "hermes"
    if "<|python_tag|>" in vocab:
        return "llama3_json"
    return None


def prompt_call_text(prompt_text: str, vocab: dict[str, int], seed: Callable[[], int]) -> str | None:
    """The text of the call the model writes for this prompt; None: no tools (or a tool result
    to answer), so it writes free text."""
    family = _family(prompt_text, vocab)
    if family is None:
        return None
    tools = prompt_tools(prompt_text)
    if not tools:
        return None
    last_tool = prompt_text.rfind(tools[-1]["function"]["name"])
    if any(prompt_text.rfind(m) > last_tool for m in _TOOL_RESULT_MARKERS):
        return None
    calls = plan_calls(tools, "required", False, seed(), ToolSettings())
    if family == "mistral_pre_v11":
        return "[TOOL_CALLS] " + dump_json([{"name": n, "arguments": a} for n, a in calls])
    fmt = {"mistral": MistralFormat, "hermes": HermesFormat, "llama3_json": Llama3JsonFormat}[family]()
    return fmt.render(calls)
