"""Token sources: what a simulated request generates."""

from __future__ import annotations

import random
from typing import Protocol


class TokenSource(Protocol):
    def next_token(self, index: int) -> int: ...


class RandomTokens:
    """Uniform ids from [0, vocab_size), never a stop or EOS id (lengths stay predictable)."""

    __slots__ = ("_rng", "_vocab", "_avoid")

    def __init__(self, rng: random.Random, vocab_size: int, avoid: frozenset[int]) -> None:
        self._rng = rng
        self._vocab = vocab_size
        self._avoid = avoid

    def next_token(self, index: int) -> int:
        t = int(self._rng.random() * self._vocab)
        while t in self._avoid:
            t = int(self._rng.random() * self._vocab)
        return t


class EchoTokens:
    """Repeats the prompt, cycling if the output is longer than the prompt."""

    __slots__ = ("_prompt",)

    def __init__(self, prompt: list[int]) -> None:
        self._prompt = prompt or [0]

    def next_token(self, index: int) -> int:
        return self._prompt[index % len(self._prompt)]


class ScriptedTokens:
    """Replays recorded ids; `finish_reason` (if any) applies once they are exhausted."""

    __slots__ = ("_ids", "_fallback")

    def __init__(self, ids: list[int], fallback: TokenSource) -> None:
        self._ids = ids
        self._fallback = fallback

    def next_token(self, index: int) -> int:
        if index < len(self._ids):
            return self._ids[index]
        return self._fallback.next_token(index)


class ReasoningConfig:
    """`--reasoning start_id,end_id,ratio`: the first part of each output is a thinking span."""

    __slots__ = ("start_id", "end_id", "ratio")

    def __init__(self, start_id: int, end_id: int, ratio: float) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"--reasoning: ratio must be in [0, 1], got {ratio}")
        self.start_id, self.end_id, self.ratio = start_id, end_id, ratio

    @classmethod
    def parse(cls, text: str) -> "ReasoningConfig":
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3:
            raise ValueError(f"--reasoning: expected START_ID,END_ID,RATIO, got {text!r}")
        try:
            return cls(int(parts[0]), int(parts[1]), float(parts[2]))
        except ValueError as e:
            raise ValueError(f"--reasoning: {e}") from None

    def thinking_tokens(self, max_tokens: int) -> int:
        """floor(max_tokens * ratio) clamped to [2, max_tokens]; 0 when there is no room."""
        raw = int(max_tokens * self.ratio)
        if max_tokens < 2 or raw == 0:
            return 0
        return min(max(raw, 2), max_tokens)


class ReasoningTokens:
    """Wraps a source: token 0 opens the thinking span, token think_len-1 closes it."""

    __slots__ = ("_inner", "_start", "_end", "_len")

    def __init__(self, inner: TokenSource, cfg: ReasoningConfig, max_tokens: int) -> None:
        self._inner = inner
        self._start, self._end = cfg.start_id, cfg.end_id
        self._len = cfg.thinking_tokens(max_tokens)

    def next_token(self, index: int) -> int:
        if self._len:
            if index == 0:
                return self._start
            if index == self._len - 1:
                return self._end
        return self._inner.next_token(index)
