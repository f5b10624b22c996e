"""Logprobs in the OpenAI shapes vLLM sends.

The simulated engine has no logits, so the values are synthetic but well-formed and
deterministic: the sampled token is the most likely one (logprob in (-4, 0]), its k-1
alternatives are other vocabulary tokens with strictly lower logprobs.
"""

from __future__ import annotations

from typing import Any

from .tokenizer import Tokenizer

_MULT = 2654435761  # Knuth's multiplicative hash: cheap, deterministic spread


def _sampled_logprob(token_id: int, position: int) -> float:
    return -round(((token_id * _MULT + position * 40503) % 4000) / 1000.0, 4)


def _alternatives(token_id: int, position: int, k: int, vocab: int, top: float) -> list[tuple[int, float]]:
    alts: list[tuple[int, float]] = []
    lp = top
    for j in range(k):
        tid = (token_id + 1 + (j + 1) * 7919 + position * 31) % max(vocab, 1)
        lp = round(lp - 0.5 - ((tid * _MULT) % 1000) / 1000.0, 4)
        alts.append((tid, lp))
    return alts


def token_logprobs(token_id: int, position: int, k: int, vocab: int) -> tuple[float, list[tuple[int, float]]]:
    """(sampled logprob, top-k list including the sampled token first)."""
    lp = _sampled_logprob(token_id, position)
    if k <= 0:
        return lp, []
    return lp, [(token_id, lp), *_alternatives(token_id, position, k - 1, vocab, lp)]


def completion_logprobs(tok: Tokenizer, token_ids: list[int], k: int, start_position: int = 0,
                        initial_text_offset: int = 0, first_is_prompt_start: bool = False) -> dict[str, Any]:
    """`CompletionLogProbs`: text_offset, token_logprobs, tokens, top_logprobs."""
    text_offset: list[int] = []
    lps: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    offset = initial_text_offset
    vocab = tok.vocab_size
    for j, tid in enumerate(token_ids):
        text = tok.token_text(tid)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if first_is_prompt_start and j == 0:
            lps.append(None)  # the first prompt token has no logprob, as in vLLM
            tops.append(None)
            continue
        lp, top = token_logprobs(tid, start_position + j, k, vocab)
        lps.append(lp)
        tops.append({tok.token_text(t): v for t, v in top} if k > 0 else {})
    return {"text_offset": text_offset, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(tok: Tokenizer, token_ids: list[int], k: int, start_position: int = 0) -> dict[str, Any]:
    """`ChatCompletionLogProbs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    vocab = tok.vocab_size
    for j, tid in enumerate(token_ids):
        lp, top = token_logprobs(tid, start_position + j, max(k, 1), vocab)
        text = tok.token_text(tid)
        content.append({
            "token": text,
            "logprob": lp,
            "bytes": list(tok.token_bytes(tid)) or list(text.encode()),
            "top_logprobs": [
                {"token": (t := tok.token_text(a)), "logprob": v, "bytes": list(tok.token_bytes(a)) or list(t.encode())}
                for a, v in top[:k]
            ],
        })
    return {"content": content}
