"""The rendered and tokenized chat prompt of a plain conversation, cached by its exact content.

A chat request's template render and tokenization depend only on the messages, the two flags and
the server's template and tokenizer. For the common shape (every message exactly a string `role`
and a string `content`; no request template, template kwargs, tools or continued final message)
the key below is the whole input, so a hit is the render's and the tokenizer's own answer. A
template that reads the clock (`strftime_now`) is never cached. Only successful renders are
stored; errors take the full path every time. Bounded: the table is cleared when full.
"""

from __future__ import annotations

from typing import Any

PromptKey = tuple[bool, bool, tuple[str, ...]]

_MAX_ENTRIES = 2048
_MAX_KEY_CHARS = 1 << 16  # long conversations are rarely repeated: not worth the memory


def template_is_pure(source: str | None) -> bool:
    """A template whose output depends on its variables only (not on the time of day)."""
    return source is not None and "strftime_now" not in source


def plain_key(messages: Any, add_generation_prompt: bool, add_special_tokens: bool) -> PromptKey | None:
    """The exact cache key of a plain conversation, or None for anything else (the slow path)."""
    if type(messages) is not list or not messages:
        return None
    flat: list[str] = []
    size = 0
    for m in messages:
        if type(m) is not dict or len(m) != 2:
            return None
        role, content = m.get("role"), m.get("content")
        if type(role) is not str or type(content) is not str or not role:
            return None
        size += len(content)
        flat.append(role)
        flat.append(content)
    if size > _MAX_KEY_CHARS:
        return None
    return (bool(add_generation_prompt), bool(add_special_tokens), tuple(flat))


class PromptCache:
    """key -> (prompt text, prompt token ids); `get` hands out a fresh list the caller owns."""

    def __init__(self, max_entries: int = _MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._table: dict[PromptKey, tuple[str, tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: PromptKey) -> tuple[str, list[int]] | None:
        hit = self._table.get(key)
        return None if hit is None else (hit[0], list(hit[1]))

    def put(self, key: PromptKey, text: str, ids: list[int]) -> None:
        if len(self._table) >= self.max_entries:
            self._table.clear()
        self._table[key] = (text, tuple(ids))


class BodyCache:
    """Request body bytes -> what a handler made of them, for a request whose handling up to its
    own ids depends on its bytes alone (the handler decides which): clients that send the same
    bodies again (load generators cycling through a prompt set) skip parsing, checks, template
    and tokenizer. Bounded in entries and in bytes held; cleared when full."""

    def __init__(self, max_entries: int = _MAX_ENTRIES, max_body: int = _MAX_KEY_CHARS,
                 max_bytes: int = 32 << 20) -> None:
        self.max_entries = max_entries
        self.max_body = max_body  # a longer body is not kept
        self.max_bytes = max_bytes
        self.size = 0
        self._table: dict[bytes, Any] = {}

    def __len__(self) -> int:
        return len(self._table)

    def get(self, body: bytes) -> Any:
        return self._table.get(body)

    def put(self, body: bytes, value: Any, held: int = 0) -> None:
        """Keep `value` for `body`; `held`: bytes the value holds beyond the body's own (an
        estimate the caller makes), counted against `max_bytes` with them."""
        if len(body) > self.max_body:
            return
        if body in self._table:  # counted when it came in
            self._table[body] = value
            return
        cost = len(body) + held
        if len(self._table) >= self.max_entries or self.size + cost > self.max_bytes:
            self._table.clear()
            self.size = 0
        self.size += cost
        self._table[body] = value
