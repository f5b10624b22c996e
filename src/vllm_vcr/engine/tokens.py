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
