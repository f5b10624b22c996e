"""Logprobs in the OpenAI shapes vLLM sends.

The simulated engine has no logits, so the values are synthetic but well-formed and
deterministic. Each position gets what vLLM's engine hands its frontend: a dict of the chosen
token first (with its rank), then the top-k tokens by rank, the chosen one not repeated, so the
dict holds k entries when the chosen token is among the top k and k+1 when it is not. Logprobs
fall strictly with the rank. Under greedy sampling the chosen token is always rank 1.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from .tokenizer import Tokenizer

_MULT = 2654435761  # Knuth's multiplicative hash: cheap, deterministic spread
_FLOOR = -9999.0  # what vLLM writes for -inf


def _rank(token_id: int, position: int, greedy: bool) -> int:
    """The chosen token's rank: mostly 1, sometimes 2-4, now and then far down (a sampled tail)."""
    if greedy:
        return 1
    h = ((token_id * _MULT) ^ (position * 40503)) % 16
    return 1 if h < 10 else 2 if h < 13 else 3 if h < 14 else 4 if h < 15 else 9


_F32 = struct.Struct("f")


def _float32(v: float) -> float:
    """The value a float32 holds (a real engine's logprobs are float32 tensors: -1.264 reaches a
    client as -1.2640000581741333)."""
    return _F32.unpack(_F32.pack(v))[0]


def _ladder(token_id: int, position: int, n: int) -> list[float]:
    """n strictly falling logprobs for ranks 1..n, as float32 values."""
    lp = -round(((token_id * _MULT + position * 40503) % 1500) / 1000.0, 4)
    out = []
    for j in range(n):
        out.append(_float32(lp))
        lp = round(lp - 0.25 - (((token_id + j) * _MULT) % 1000) / 1000.0, 4)
    return out


def step_logprobs(token_id: int, position: int, k: int, vocab: int,
                  greedy: bool = False) -> list[tuple[int, float, int]]:
    """One position's (token id, logprob, rank) entries in vLLM's order: the chosen token, then the
    top k by rank without it."""
    rank = _rank(token_id, position, greedy)
    ladder = _ladder(token_id, position, max(k, rank))
    out = [(token_id, ladder[rank - 1], rank)]
    vocab = max(vocab, 2)
    seen = {token_id}
    for r in range(1, k + 1):
        if r == rank:
            continue
        tid = (token_id + 1 + r * 7919 + position * 31) % vocab
        while tid in seen:
            tid = (tid + 1) % vocab
        seen.add(tid)
        out.append((tid, ladder[r - 1], r))
    return out


def token_logprobs(token_id: int, position: int, k: int, vocab: int) -> tuple[float, list[tuple[int, float]]]:
    """(chosen token's logprob, the entries of its position as (id, logprob)) - the older API."""
    entries = step_logprobs(token_id, position, k, vocab)
    return entries[0][1], [(t, lp) for t, lp, _ in entries] if k > 0 else []


def tokens_as_ids(req: Any, server_default: bool) -> bool:
    """Whether logprobs name tokens by id: the request's `return_tokens_as_token_ids`, else the
    server's --return-tokens-as-token-ids."""
    value = getattr(req, "return_tokens_as_token_ids", None)
    return server_default if value is None else bool(value)


def token_id_placeholder(token_id: int) -> str:
    """A token named by its id (`return_tokens_as_token_ids`), as vLLM writes it."""
    return f"token_id:{token_id}"


def completion_logprobs(tok: Tokenizer, token_ids: list[int], k: int, start_position: int = 0,
                        initial_text_offset: int = 0, first_is_prompt_start: bool = False,
                        greedy: bool = False, as_ids: bool = False) -> dict[str, Any]:
    """`CompletionLogProbs`: text_offset, token_logprobs, tokens, top_logprobs (up to k+1 entries
    per token, keyed by text, as vLLM's frontend writes them). `as_ids`: tokens named by their ids
    (their offsets count those names, as vLLM's do)."""
    text_offset: list[int] = []
    lps: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    offset = initial_text_offset
    vocab = tok.vocab_size
    every = k == -1
    name = token_id_placeholder if as_ids else tok.token_text
    for j, tid in enumerate(token_ids):
        text = name(tid)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if first_is_prompt_start and j == 0:
            lps.append(None)  # the first prompt token has no logprob, as in vLLM
            tops.append(None)
            continue
        entries = step_logprobs(tid, start_position + j, vocab if every else max(k, 0), vocab, greedy)
        lps.append(entries[0][1])
        tops.append({name(t): lp for t, lp, _ in entries})
    return {"text_offset": text_offset, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(tok: Tokenizer, token_ids: list[int], k: int, start_position: int = 0,
                  greedy: bool = False, as_ids: bool = False) -> dict[str, Any]:
    """`ChatCompletionLogProbs`: {"content": [{token, logprob, bytes, top_logprobs}]}; top_logprobs
    are the first k entries of the position's dict (the chosen token first), as vLLM lists them.
    `as_ids`: tokens named by their ids (a sampled token's `bytes` stay its text's, the top entries'
    are their names', as vLLM writes them)."""
    content = []
    vocab = tok.vocab_size
    k = vocab if k == -1 else max(k, 0)
    name = token_id_placeholder if as_ids else tok.token_text
    for j, tid in enumerate(token_ids):
        entries = step_logprobs(tid, start_position + j, k, vocab, greedy)
        text = tok.token_text(tid)
        content.append({
            "token": token_id_placeholder(tid) if as_ids else text,
            "logprob": entries[0][1],
            "bytes": list(tok.token_bytes(tid)) or list(text.encode()),
            "top_logprobs": [
                {"token": (t := name(a)), "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                for a, v, _ in entries[:k]
            ],
        })
    return {"content": content}


def prompt_logprobs(tok: Tokenizer, prompt_ids: list[int], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """`prompt_logprobs` of a response: None for the first prompt token, then per token the dict
    {id: {logprob, rank, decoded_token}} of the prompt token and the top k (vLLM's Logprob)."""
    vocab = tok.vocab_size
    every = k == -1
    out: list[dict[str, dict[str, Any]] | None] = [None] if prompt_ids else []
    for j in range(1, len(prompt_ids)):
        entries = step_logprobs(prompt_ids[j], j - len(prompt_ids), vocab if every else max(k, 0), vocab)
        out.append({str(t): {"logprob": max(lp, _FLOOR), "rank": r, "decoded_token": tok.token_text(t)}
                    for t, lp, r in entries})
    return out


OFFLOAD_PROMPT_TOKENS = 2_000  # more prompt positions than this are computed in a worker thread


async def prompt_logprobs_many(tok: Tokenizer, prompts: list[list[int]], k: int) -> list[Any]:
    """`prompt_logprobs` of each prompt; many positions in a worker thread, so that the event loop
    keeps serving while they are built (their count is bounded by check_prompt_logprobs_budget)."""
    def build() -> list[Any]:
        return [prompt_logprobs(tok, ids, k) for ids in prompts]

    if sum(len(ids) for ids in prompts) <= OFFLOAD_PROMPT_TOKENS:
        return build()
    return await asyncio.to_thread(build)
