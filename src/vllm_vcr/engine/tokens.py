"""Token sources: what a simulated request generates."""

from __future__ import annotations

import _random
import bisect
import math
import random
from collections.abc import Iterator
from itertools import chain, islice, repeat, starmap
from typing import Any, Protocol

# sampling_params.extra_args key of ids a frontend planned (a tool call, a schema instance): the
# engine emits them verbatim, and they end the output themselves
PLANNED_OUTPUT_KEY = "vllm_vcr_planned_output_ids"
BIAS_EXCLUDES = -100.0  # vLLM clamps logit_bias to [-100, 100]; -100 takes a token out of the draw


try:  # the sha512 `random` seeds a str or bytes seed with (builtin, as random.py imports it)
    from _sha2 import sha512 as _sha512  # Python >= 3.12
except ImportError:  # pragma: no cover - version dependent
    try:
        from _sha512 import sha512 as _sha512  # Python 3.11
    except ImportError:
        from hashlib import sha512 as _sha512
_new_random = random.Random.__new__  # (allocates only: random.Random.__init__ seeds)
_c_seed = _random.Random.seed


def seeded_random(seed: int | bytes) -> random.Random:
    """`random.Random(seed)` for an int or a bytes seed, in the same state, without `Random.seed`'s
    Python layer (a request's generator is seeded once per request): version 2 seeding, which
    for bytes seeds the C generator with `int.from_bytes(seed + sha512(seed).digest())` and for
    an int with the int (tests/engine/test_random_tokens.py holds it to `random.Random`)."""
    t = type(seed)
    if t is bytes:
        key = int.from_bytes(seed + _sha512(seed).digest(), "big")
    elif t is int:
        key = seed
    else:
        return random.Random(seed)
    rng = _new_random(random.Random)
    _c_seed(rng, key)
    rng.gauss_next = None
    return rng


class TokenSource(Protocol):
    def next_token(self, index: int) -> int: ...


class RandomTokens:
    """Uniform ids from [0, vocab_size), never a stop or EOS id (lengths stay predictable).

    Ids are drawn `DRAW_BATCH` at a time, so a request's ids depend only on its seed, not on
    how many the engine takes per step (one, or a zero-latency burst)."""

    __slots__ = ("_rng", "_vocab", "_avoid", "_ahead", "ids")
    DRAW_BATCH = 64

    def __init__(self, rng: random.Random, vocab_size: int, avoid: frozenset[int]) -> None:
        self._rng = rng
        self._vocab = vocab_size
        self._avoid = avoid
        self._ahead: list[Any] = []  # a batch drawn before the ids reached it (draw_ahead)
        # every id in order: `next(ids)` is one (the steady decode's draw; a generator resumes
        # without the call frame a method costs)
        self.ids = _random_ids(rng, vocab_size, avoid, self._ahead)

    def next_token(self, index: int) -> int:
        return next(self.ids)

    def take(self, k: int) -> list[int]:
        """The next k ids (the same ids k calls of next_token would give)."""
        return list(islice(self.ids, k))

    def draw_ahead(self, needed: int = DRAW_BATCH) -> None:
        """Draw the first batch now (on admission) instead of with the first token: under a burst
        every first token is due at about the same time, and the ids do not depend on when.
        `needed`: how many ids the request can take at most. Fewer than a batch are drawn when
        none of them is avoided; the rest of the batch is drawn if it is ever reached, and the
        ids are the same either way (a short request draws a few numbers, not 64)."""
        if not self._ahead:
            n = self.DRAW_BATCH
            if needed >= n:
                self._ahead.append(_draw(self._rng, self._vocab, self._avoid, n))
                return
            k = max(needed, 1)
            ids = _raw_draw(self._rng.random, self._vocab, k)
            if self._avoid.isdisjoint(ids):
                # the batch's first k ids (none is redrawn); its other n - k follow when reached
                self._ahead += [n - k, ids]  # (popped from the end: ids first)
            else:  # a redraw follows the whole batch's draws: draw it whole
                ids += _raw_draw(self._rng.random, self._vocab, n - k)
                self._ahead.append(_redrawn(ids, self._rng.random, self._vocab, self._avoid))


def _random_ids(rng: random.Random, vocab: int, avoid: frozenset[int], ahead: list[list[int]]) -> Iterator[int]:
    # (holds no reference to its RandomTokens: a request's ids leave no reference cycle behind; a
    # token is a step of C iterators, the generator resumes once per batch drawn)
    return chain.from_iterable(_draws(rng, vocab, avoid, ahead))


def _draws(rng: random.Random, vocab: int, avoid: frozenset[int], ahead: list) -> Iterator[list[int]]:
    while True:
        if not ahead:
            yield _draw(rng, vocab, avoid, RandomTokens.DRAW_BATCH)
            continue
        batch = ahead.pop()
        # an int: the rest of a batch whose first ids went ahead (RandomTokens.draw_ahead)
        yield _draw(rng, vocab, avoid, batch) if type(batch) is int else batch


def _raw_draw(rand, vocab: int, n: int) -> list[int]:
    # int(rand() * vocab) for each of n draws, the loop in C (a float product is the same either
    # way round, and vocab converts to float exactly)
    return list(map(int, map(float(vocab).__mul__, starmap(rand, repeat((), n)))))


def _draw(rng: random.Random, vocab: int, avoid: frozenset[int], n: int) -> list[int]:
    rand = rng.random
    ids = _raw_draw(rand, vocab, n)
    return ids if avoid.isdisjoint(ids) else _redrawn(ids, rand, vocab, avoid)


def _redrawn(ids: list[int], rand, vocab: int, avoid: frozenset[int]) -> list[int]:
    """A batch's avoided ids drawn again, in order, after the whole batch's draws."""
    if not avoid.isdisjoint(ids):
        for j, t in enumerate(ids):
            while t in avoid:
                t = int(rand() * vocab)
            ids[j] = t
    return ids


class CountedTokens:
    """Token ids for a driver that never reads them (the offline simulator): no random draw, the
    request's arrival number spelt in two ids (from disjoint halves of the vocabulary), its low
    digit first, repeated. What ids are for there: a preempted request's output blocks are hashed
    for its resume, and must be its own, as random ids would be (two requests' ids never form the
    same block; a block that holds only a first output token differs between any two requests
    fewer than half a vocabulary apart in arrival)."""

    __slots__ = ("_ids",)

    def __init__(self, seq: int, vocab_size: int) -> None:
        half = max(vocab_size // 2, 1)
        hi, lo = divmod(seq, half)
        self._ids = (lo, half + hi % half)

    def next_token(self, index: int) -> int:
        return self._ids[index & 1]

    def take(self, k: int) -> list[int]:
        return list(self._ids) * (k // 2) + list(self._ids[:k & 1])

    def take_from(self, index: int, k: int) -> list[int]:
        """The ids of output indices `index`..`index + k - 1` (what `next_token` gives for each)."""
        ids = self._ids
        return [ids[i & 1] for i in range(index, index + k)]


class BiasedTokens:
    """Ids drawn as a model with flat logits would draw them under `logit_bias` and
    `allowed_token_ids`: each candidate weighs exp(bias) (1 without one), a bias of -100 excludes
    it, and `allowed_token_ids` (when given) are the only candidates.

    Ending ids (EOS, stop_token_ids, reasoning markers: `ending`) stay out of the unbiased draw, as
    in `RandomTokens`, unless the request names them itself (a positive bias, or an allowed id):
    then they may be drawn, and end the request as a model's would, but never before `min_tokens`
    (vLLM's min-tokens logits processor). Only requests with a bias or allowed ids use this class;
    every other random request keeps `RandomTokens`' batch draw."""

    __slots__ = ("_rng", "_min_tokens", "_early", "_late")

    def __init__(self, rng: random.Random, vocab_size: int, ending: frozenset[int], min_tokens: int,
                 bias: dict[int, float] | None, allowed: list[int] | None) -> None:
        self._rng, self._min_tokens = rng, min_tokens
        bias = bias or {}
        named = {t for t, b in bias.items() if b > 0} | set(allowed or ())
        drawable_endings = frozenset(t for t in ending if t in named and bias.get(t, 0.0) > BIAS_EXCLUDES)
        self._late = _WeightedDraw(vocab_size, ending - drawable_endings, bias, allowed)
        self._early = (_WeightedDraw(vocab_size, ending, bias, allowed) if drawable_endings and min_tokens > 0
                       else self._late)

    def next_token(self, index: int) -> int:
        draw = self._early if index < self._min_tokens else self._late
        return draw.pick(self._rng)


def can_sample(token: int, allowed: list[int] | None, bias: dict[int, float] | None) -> bool:
    """Whether `allowed_token_ids` and `logit_bias` leave `token` in the draw."""
    if allowed is not None and token not in allowed:
        return False
    return not bias or bias.get(token, 0.0) > BIAS_EXCLUDES


class _WeightedDraw:
    """One weighted draw over the vocabulary: explicit candidates (allowed ids, biased ids) by
    cumulative weight, the rest (unbiased ids, weight 1 each) uniformly by rejection."""

    __slots__ = ("_vocab", "_ids", "_cum", "_named_total", "_total", "_skip")

    def __init__(self, vocab_size: int, excluded: frozenset[int], bias: dict[int, float],
                 allowed: list[int] | None) -> None:
        self._vocab = vocab_size
        # the frontend checked the ids against the model's vocabulary, which may hold special tokens
        # above the ordinary ids the uniform draw takes (`vocab_size`)
        named = list(dict.fromkeys(allowed)) if allowed is not None else list(bias)
        ids, cum, total = [], [], 0.0
        for t in named:
            b = bias.get(t, 0.0)
            if t in excluded or b <= BIAS_EXCLUDES:
                continue
            total += math.exp(b)
            ids.append(t)
            cum.append(total)
        self._named_total = total
        self._skip = frozenset(bias) | excluded  # never drawn by the uniform rest
        rest = 0 if allowed is not None else vocab_size - sum(1 for t in self._skip if 0 <= t < vocab_size)
        if total == 0.0 and rest == 0:  # nothing left to draw: fall back to the named ids, unweighted
            ids = named or [0]
            cum = [float(i + 1) for i in range(len(ids))]
            total = self._named_total = float(len(ids))
        self._ids, self._cum, self._total = ids, cum, total + rest
        if rest and rest * 2 < vocab_size:  # a mostly excluded vocabulary: list the rest once
            self._ids = ids + [t for t in range(vocab_size) if t not in self._skip]
            self._cum = cum + [total + i + 1 for i in range(rest)]
            self._named_total = self._total

    def pick(self, rng: random.Random) -> int:
        u = rng.random() * self._total
        if u < self._named_total:
            return self._ids[min(bisect.bisect_right(self._cum, u), len(self._ids) - 1)]
        vocab, skip = self._vocab, self._skip
        t = int(rng.random() * vocab)
        while t in skip:
            t = int(rng.random() * vocab)
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
