"""Tool-call text formats of vLLM's --tool-call-parser choices: how a model writes calls, and how
the parser reads them back.

`render(calls)` is the text a model of that family emits for the calls; `parse(text)` is what the
parser's non-streaming extraction returns: (content, calls) with arguments re-serialised as JSON
text (`json.dumps(..., ensure_ascii=False)`, as the parsers do). `partial(text)` reads a text
still being generated: content safe to send so far and, per call started, its name (once known)
and the argument text so far.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from ..structured.instances import dump_json


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class PartialCall:
    name: str | None
    arguments: str  # the argument text generated so far (a prefix of the final JSON text)
    complete: bool


def _balanced_end(text: str, start: int) -> int | None:
    """Index just past the JSON value opening at `start` ({ or [), None while it is still open."""
    depth = 0
    in_str = esc = False
    for k in range(start, len(text)):
        c = text[k]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')


def _json_call_partial(body: str, args_key_re: re.Pattern) -> PartialCall:
    """A {"name": ..., "arguments": {...}} object still being written."""
    m = _NAME.search(body)
    name = m.group(1) if m else None
    a = args_key_re.search(body)
    if not a or name is None:
        return PartialCall(name, "", False)
    start = a.end()
    end = _balanced_end(body, start) if start < len(body) and body[start] in "{[" else None
    args = body[start:end] if end is not None else body[start:]
    return PartialCall(name, args, end is not None)


class ToolCallFormat:
    name = ""
    # tool_choice "required"/named: this parser reads JSON (a list of {name, parameters}, or the
    # bare arguments) rather than its own format (vLLM: supports_required_and_named)
    json_for_forced = False
    # vLLM's streamed argument fragments of this parser carry `"type": "function"` as well
    typed_argument_deltas = False
    # its streamed deltas with tool calls carry `"content": null` (hermes sets the field explicitly)
    null_content_in_call_deltas = False
    # its parser answers every token after a complete call with an empty fragment, so the finish
    # chunk carries `{index, function: {arguments: ""}}` (llama3_json re-reads the whole JSON)
    empty_fragment_at_finish = False

    def call_id(self) -> str:
        """A tool call's id as this parser makes it."""
        return f"chatcmpl-tool-{secrets.token_hex(8)}"

    def render(self, calls: list[tuple[str, Any]]) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def partial(self, text: str) -> tuple[str, list[PartialCall]]:
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    name = "hermes"
    null_content_in_call_deltas = True
    START, END = "<tool_call>", "</tool_call>"
    _ARGS = re.compile(r'"arguments"\s*:\s*')
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.START}\n{dump_json({'name': n, 'arguments': a})}\n{self.END}" for n, a in calls)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.START not in text:
            return text, []
        try:
            raw = [json.loads(m[0] or m[1]) for m in self._CALL.findall(text)]
            calls = [ParsedCall(c["name"], dump_json(c["arguments"])) for c in raw]
        except (ValueError, KeyError, TypeError):
            return text, []
        content = text[: text.find(self.START)]
        return content or None, calls

    def partial(self, text: str) -> tuple[str, list[PartialCall]]:
        first = text.find(self.START)
        content = text[: len(text) - _partial_overlap(text, self.START)] if first == -1 else text[:first]
        calls = []
        pos = first
        while pos != -1:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:end] if end != -1 else text[body_start:]
            calls.append(_json_call_partial(body, self._ARGS))
            pos = text.find(self.START, end + len(self.END)) if end != -1 else -1
        return content, calls


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    empty_fragment_at_finish = True
    _ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(dump_json({"name": n, "parameters": a}) for n, a in calls)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if "<|python_tag|>" not in text and "{" not in text:
            return text, []
        decoder = json.JSONDecoder()
        calls, end = [], -1
        for m in re.finditer(r"\{", text):
            if m.start() <= end:
                continue
            try:
                obj, n = decoder.raw_decode(text[m.start():])
                end = m.start() + n
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(ParsedCall(obj["name"], dump_json(args)))
            except (ValueError, KeyError, TypeError):
                return text, []
        return (None, calls) if calls else (text, [])

    def partial(self, text: str) -> tuple[str, list[PartialCall]]:
        stripped = text.lstrip()
        if not stripped.startswith(("{", "<|python_tag|>")):
            return text, []
        calls, pos = [], stripped.find("{")
        while pos != -1:
            end = _balanced_end(stripped, pos)
            calls.append(_json_call_partial(stripped[pos:end] if end else stripped[pos:], self._ARGS))
            pos = stripped.find("{", end) if end else -1
        return "", calls


class MistralFormat(ToolCallFormat):
    name = "mistral"
    BOT = "[TOOL_CALLS]"
    typed_argument_deltas = True
    _ID_CHARS = string.ascii_letters + string.digits

    def call_id(self) -> str:
        """Mistral's tool-call ids: 9 letters and digits."""
        return "".join(secrets.choice(self._ID_CHARS) for _ in range(9))

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(f"{self.BOT}{n}[ARGS]{dump_json(a)}" for n, a in calls)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.BOT not in text:
            return text, []
        content = text[: text.find(self.BOT)]
        calls = []
        try:
            for seg in text.split(self.BOT)[1:]:
                if "[ARGS]" in seg:
                    name, args = seg.split("[ARGS]", 1)
                    calls.append(ParsedCall(name.strip(), dump_json(json.loads(args))))
                else:  # the older form: a JSON list of {name, arguments}
                    calls += [ParsedCall(c["name"], dump_json(c["arguments"])) for c in json.loads(seg)]
        except (ValueError, KeyError, TypeError):
            return text, []
        return content or None, calls

    def partial(self, text: str) -> tuple[str, list[PartialCall]]:
        first = text.find(self.BOT)
        if first == -1:
            return text[: len(text) - _partial_overlap(text, self.BOT)], []
        calls = []
        for seg in text[first:].split(self.BOT)[1:]:
            if "[ARGS]" not in seg:
                calls.append(PartialCall(None, "", False))
                continue
            name, args = seg.split("[ARGS]", 1)
            end = _balanced_end(args, 0) if args.startswith("{") else None
            calls.append(PartialCall(name.strip(), args if end is None else args[:end], end is not None))
        return text[:first], calls


class PythonicFormat(ToolCallFormat):
    name = "pythonic"
    json_for_forced = True

    def render(self, calls: list[tuple[str, Any]]) -> str:
        def call(n: str, a: Any) -> str:
            return f"{n}({', '.join(f'{k}={_py(v)}' for k, v in (a or {}).items())})"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        s = text.strip()
        if not (s.startswith("[") and s.endswith("]")):
            return text, []
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
                return text, []
            calls = [ParsedCall(_dotted(e.func), dump_json({kw.arg: ast.literal_eval(kw.value) for kw in e.keywords}))
                     for e in tree.elts]
        except (SyntaxError, ValueError, TypeError):
            return text, []
        return None, calls

    def partial(self, text: str) -> tuple[str, list[PartialCall]]:
        # pythonic calls are only read once the whole list is there
        if not text.lstrip().startswith("["):
            return text, []
        content, calls = self.parse(text)
        if not calls:
            return "", []
        return "", [PartialCall(c.name, c.arguments, True) for c in calls]


def _py(v: Any) -> str:
    return repr(v)  # JSON values are Python literals: dict, list, str, int, float, bool, None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("not a function name")


FORMATS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat, "llama3_json": Llama3JsonFormat, "llama4_json": Llama3JsonFormat,
    "mistral": MistralFormat, "pythonic": PythonicFormat,
}


def get_format(parser: str) -> ToolCallFormat:
    return FORMATS[parser]()
