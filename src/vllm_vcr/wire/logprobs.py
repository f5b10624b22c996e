"""Sample and prompt logprobs on the wire, in the arrays vLLM's sampler hands its frontend.

A request with `logprobs` (or `prompt_logprobs`) must get them from the engine: the frontend's
LogprobsProcessor appends one position per row it receives and its serving layer indexes those
positions by output token, so an engine that sends none makes the real frontend fail the request
(HTTP 500 "list index out of range"). Layout (vllm/v1/outputs.py, the same in 0.32 and 0.33):

* `EngineCoreOutput.new_logprobs` = LogprobsLists `[token_ids, logprobs, ranks, None]`: numpy
  arrays of shape [T, K+1], [T, K+1] and [T] for the T new tokens; column 0 is the sampled token,
  columns 1..K the top K by rank (the sampled token again if it is among them); `ranks` is the
  sampled token's rank. Encoded as numpy arrays: `[dtype.str, shape, Ext 3]`.
* `EngineCoreOutput.new_prompt_logprobs_tensors` = LogprobsTensors, the same three for prompt
  positions 1..P-1 (the first prompt token has none), but torch tensors: `[torch dtype name,
  shape, Ext 3]`; the frontend looks the name up with `getattr(torch, name)`.

K = -1 asks for the whole vocabulary. The values are serve's synthetic ones
(`frontend/logprobs.step_logprobs`): deterministic, falling with rank, rank 1 under greedy sampling.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..engine.types import EngineCoreOutput, EngineCoreRequest
from ..frontend.logprobs import step_logprobs
from .codec import EXT_RAW_VIEW


class RequestLogprobs:
    """What one request asked for, and how many output positions it has had so far."""

    __slots__ = ("k", "prompt_k", "greedy", "prompt", "position")

    def __init__(self, k: int | None, prompt_k: int | None, greedy: bool, prompt: list[int]) -> None:
        self.k = k
        self.prompt_k = prompt_k
        self.greedy = greedy
        self.prompt = prompt if prompt_k is not None else None
        self.position = 0

    @classmethod
    def of(cls, req: EngineCoreRequest) -> RequestLogprobs | None:
        sp = req.sampling_params
        if sp is None or (sp.logprobs is None and sp.prompt_logprobs is None):
            return None
        return cls(sp.logprobs, sp.prompt_logprobs, sp.temperature < 1e-5, req.prompt_token_ids or [])


class LogprobsAttacher:
    """Fills the logprob fields of a bridge's outputs for the requests that asked for them."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab = max(int(vocab_size), 2)
        self.requests: dict[str, RequestLogprobs] = {}

    def add(self, req: EngineCoreRequest) -> None:
        want = RequestLogprobs.of(req)
        if want is not None:
            self.requests[req.request_id] = want

    def discard(self, request_ids) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def attach(self, out: EngineCoreOutput) -> None:
        want = self.requests.get(out.request_id)
        if want is None:
            return
        if out.finish_reason is not None:
            del self.requests[out.request_id]
        if not out.new_token_ids:
            return  # an error or abort: nothing was sampled
        if want.prompt is not None:  # with the request's first tokens, as after its prefill
            out.new_prompt_logprobs_tensors = prompt_tensors(want.prompt, want.prompt_k, self.vocab)
            want.prompt = None
        if want.k is not None:
            out.new_logprobs = sample_lists(out.new_token_ids, want.position, want.k, self.vocab, want.greedy)
        want.position += len(out.new_token_ids)


def _rows(token_ids: list[int], positions, k: int, vocab: int, greedy: bool):
    """ids [n, K+1], logprobs [n, K+1], ranks [n] for tokens at the given positions."""
    # -1: the whole vocabulary; at most vocab-1 columns besides the sampled token, so the ids of a
    # row stay distinct even when the sampled token ranks below them
    width = min(vocab if k == -1 else max(k, 0), vocab - 1)
    ids = np.empty((len(token_ids), width + 1), dtype=np.int32)
    lps = np.empty((len(token_ids), width + 1), dtype=np.float32)
    ranks = np.empty(len(token_ids), dtype=np.int64)
    for row, (tid, pos) in enumerate(zip(token_ids, positions)):
        entries = step_logprobs(tid, pos, width, vocab, greedy)
        chosen, chosen_lp, rank = entries[0]
        by_rank = {r: (t, lp) for t, lp, r in entries[1:]}
        if rank <= width:
            by_rank[rank] = (chosen, chosen_lp)
        ids[row, 0], lps[row, 0], ranks[row] = chosen, chosen_lp, rank
        for r in range(1, width + 1):
            ids[row, r], lps[row, r] = by_rank[r]
    return ids, lps, ranks


def sample_lists(token_ids: list[int], start: int, k: int, vocab: int, greedy: bool) -> list[Any]:
    """LogprobsLists for this step's tokens (output positions start, start+1, ...)."""
    ids, lps, ranks = _rows(token_ids, range(start, start + len(token_ids)), k, vocab, greedy)
    return [ids, lps, ranks, None]  # numpy arrays: the codec writes [dtype.str, shape, Ext 3]


def prompt_tensors(prompt: list[int], k: int, vocab: int) -> list[Any] | None:
    """LogprobsTensors for prompt positions 1..P-1 (None for a one-token prompt: nothing to score)."""
    if len(prompt) < 2:
        return None
    scored = prompt[1:]
    ids, lps, ranks = _rows(scored, range(1 - len(prompt), 0), k, vocab, greedy=False)
    return [_tensor(ids, "int32"), _tensor(lps, "float32"), _tensor(ranks, "int64"), None, None]


def _tensor(arr: np.ndarray, torch_dtype: str) -> list[Any]:
    """vLLM's torch.Tensor encoding: the dtype by its torch name, not numpy's `<i4`."""
    return [torch_dtype, list(arr.shape), msgspec.msgpack.Ext(EXT_RAW_VIEW, np.ascontiguousarray(arr).tobytes())]
