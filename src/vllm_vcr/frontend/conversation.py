"""The conversation as vLLM hands it to the chat template (its renderer's message parsing).

Each message becomes the keys vLLM keeps (role, content; an assistant's tool calls and
reasoning, a tool message's tool_call_id, a string name or task, a developer message's tools)
with its content in the template's shape (frontend/content_format.py): one string, or OpenAI's
list of parts. An assistant's tool-call arguments reach the template as an object (a JSON
string parsed; anything that is not a JSON object: `{}`), and an empty list of tool calls is
dropped, so a template's `arguments | tojson` renders what vLLM renders.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .errors import bad_request, sanitize

logger = logging.getLogger("vllm_vcr.serve")

# the keys of OpenAI's content parts: a text part's other keys reach an `openai`-format template with it
_PART_FIELDS = frozenset({"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
                          "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
                          "thinking", "type", "uuid", "video_embeds", "video_url"})
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's attribution line (its value changes per request)
# the text of each text-like part type, by the key that holds it
_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# parts that carry media (also a part without a type that holds one of these keys): a text-only model refuses them
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio",
                          "audio_embeds", "video_url", "video_embeds"})


def normalize_messages(messages: list[dict[str, Any]], content_format: str = "string",
                       model_name: str = "") -> list[dict[str, Any]]:
    """Messages as vLLM gives them to the chat template: in the `string` content format each
    content a string (its text parts joined by newlines, none: ""), in the `openai` format a list
    of text parts (a string content one part; a tool message's text parts still joined), a system
    message's leading Claude Code billing-header line dropped (frontend/content_format.py). A
    media part gets vLLM's 400 for a model without a multimodal processor (`model_name`'s)."""
    out = []
    parts_out = content_format == "openai"
    for k, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"messages[{k}]: 'role' must be a non-empty string.", "messages")
        content = m.get("content")
        if (isinstance(content, str) and not parts_out and len(m) == 2 and role != "developer"
                and (role != "system" or not content.startswith(BILLING_HEADER))):
            out.append(m)  # (the common case, a role and a string: the message as it came)
            continue
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [content]
        elif not isinstance(content, list):
            raise bad_request(f"messages[{k}].content must be a string or a list of content parts.", "messages")
        parts = []  # (its text, the part it came from: None for a string)
        for part in content:
            if isinstance(part, str):
                parts.append((part, None))
                continue
            if not isinstance(part, dict):
                raise bad_request(f"messages[{k}].content: each part must be an object.", "messages")
            ptype = part.get("type")
            key = _TEXT_KEYS.get(ptype) if isinstance(ptype, str) else None
            if key is not None:
                text = part.get(key)
                if not isinstance(text, str):
                    raise bad_request(f"messages[{k}].content: a '{ptype}' part needs a string '{key}'.", "messages")
                parts.append((text, part))
            elif ptype == "tool_reference" and isinstance(part.get("name"), str):
                parts.append((part["name"], {"type": "tool_reference"}))  # (kept as a part for the template)
            elif ptype in _MEDIA_PARTS or (ptype is None and not _MEDIA_PARTS.isdisjoint(part)):
                raise bad_request(sanitize(f"{model_name} is not a multimodal model"))
            else:
                raise bad_request(f"messages[{k}].content: part type {ptype!r} is not supported by this "
                                  "text-only model.", "messages")
        if role == "system":
            parts = _without_billing_header(parts)
        if parts_out and (role != "tool" or any(part is not None and part.get("type") == "tool_reference"
                                                for _, part in parts)):
            shaped: Any = [_as_part(text, part) for text, part in parts]
        else:
            shaped = "\n".join(text for text, _ in parts)
        out.append(_template_message(m, role, shaped))
    return out


def _template_message(m: dict[str, Any], role: str, content: Any) -> dict[str, Any]:
    """The keys of a message vLLM gives the template: the others are dropped."""
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None:
            calls = _template_tool_calls(calls)
            if calls is not None:
                msg["tool_calls"] = calls
        reasoning = m.get("reasoning")
        if reasoning is None:  # (the deprecated name, as vLLM renames it)
            reasoning = m.get("reasoning_content")
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        msg["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            msg[key] = m[key]
    if role == "developer":
        msg["tools"] = m.get("tools")
    return msg


def _template_tool_calls(calls: Any) -> Any:
    """An assistant's tool calls as the template gets them (None: none, the key dropped)."""
    if not isinstance(calls, list):
        return calls
    if not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise bad_request("assistant tool_calls entries must be objects.", "tool_calls")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request("chat completions only support assistant tool_calls of type 'function'.", "tool_calls")
        out.append({**call, "function": {**fn, "arguments": _arguments_object(fn.get("name"), fn.get("arguments"))}})
    return out


def _arguments_object(name: Any, arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as an object: a JSON object string parsed, a mapping as it is;
    anything else (no arguments, text that is not JSON, JSON that is not an object) `{}`, so a
    turn with a malformed call in its history still renders, as in vLLM."""
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    parsed: Any = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            logger.warning("Tool call %r has arguments that are not valid JSON (%d chars); coercing to an empty "
                           "object so the conversation can continue.", name, len(arguments))
            return {}
    if not isinstance(parsed, dict):
        logger.warning("Tool call %r arguments decoded to %s, not a JSON object; coercing to an empty object.",
                       name, type(parsed).__name__)
        return {}
    return parsed


def _as_part(text: str, part: dict[str, Any] | None) -> dict[str, Any]:
    """One part as an `openai`-format template gets it: a text part (its other keys kept), or a tool reference."""
    if part is not None and part.get("type") == "tool_reference":
        return {"type": "tool_reference", "name": text}
    return {"type": "text", "text": text,
            **({key: v for key, v in part.items() if key not in _PART_FIELDS} if part else {})}


def _without_billing_header(parts: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A system message's parts without the first line of each text part that is Claude Code's
    attribution header (its value changes per request), as vLLM drops it."""
    kept = []
    for text, part in parts:
        if text.startswith(BILLING_HEADER) and (part is None or part.get("type") == "text"):
            text = text.partition("\n")[2]
            if not text:
                continue
        kept.append((text, part))
    return kept


def content_text(content: Any) -> str:
    """A message content's text: a string as it is, parts' texts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content or ""


def developer_as_system(conv: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """vLLM's rule for a template that never names the developer role: each developer message
    becomes a system message (its tools dropped), and the system messages then merge into one,
    first, when one stood later or there were several (their texts joined by a blank line)."""
    if template is None or '"developer"' in template or "'developer'" in template \
            or not any(m.get("role") == "developer" for m in conv):
        return conv
    conv = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m.get("role") == "developer" else m
            for m in conv]
    systems = [i for i, m in enumerate(conv) if m.get("role") == "system"]
    if not systems or systems == [0]:
        return conv
    merged = {"role": "system",
              "content": "\n\n".join(c for i in systems if (c := content_text(conv[i].get("content"))))}
    return [merged, *(m for m in conv if m.get("role") != "system")]
