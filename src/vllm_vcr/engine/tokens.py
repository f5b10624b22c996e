"""Token sources: what a simulated request generates."""

from __future__ import annotations

import random
from typing import Protocol


class TokenSource(Protocol):
    def next_token(self, index: int) -> int: ...


class RandomTokens:
    """Uniform ids from [0, vocab_size), never a stop or EOS id (lengths stay predictable).

    Ids are drawn `DRAW_BATCH` at a time, so a request's ids depend only on its seed, not on
    how many the engine takes per step (one, or a zero-latency burst)."""

    __slots__ = ("_rng", "_vocab", "_avoid", "_buf", "_pos")
    DRAW_BATCH = 64

    def __init__(self, rng: random.Random, vocab_size: int, avoid: frozenset[int]) -> None:
        self._rng = rng
        self._vocab = vocab_size
        self._avoid = avoid
        self._buf: list[int] = []
        self._pos = 0

    def next_token(self, index: int) -> int:
        pos = self._pos
        if pos >= len(self._buf):
            self._buf, pos = self._draw(), 0
        self._pos = pos + 1
        return self._buf[pos]

    def take(self, k: int) -> list[int]:
        """The next k ids (the same ids k calls of next_token would give)."""
        buf, pos = self._buf, self._pos
        while len(buf) - pos < k:
            buf, pos = buf[pos:] + self._draw(), 0
        self._buf, self._pos = buf, pos + k
        return buf[pos:pos + k]

    def _draw(self) -> list[int]:
        rand, vocab, avoid = self._rng.random, self._vocab, self._avoid
        ids = [int(rand() * vocab) for _ in range(self.DRAW_BATCH)]
        if not avoid.isdisjoint(ids):
            for j, t in enumerate(ids):
                while t in avoid:
                    t = int(rand() * vocab)
                ids[j] = t
        return ids


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
