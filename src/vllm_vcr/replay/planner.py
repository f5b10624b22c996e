"""Replaying a recording through the engine: `--replay-tokens`, `--replay-steps`, `--replay-match`.

A trace becomes a planner (engine/plan.py): each arriving request is matched to a recorded
request, whose output token ids and finish reason (`--replay-tokens`) and/or first-token delay
and per-chunk gaps (`--replay-steps`) the engine then replays verbatim.

Matching (`--replay-match`):
- `index`: the load generator's `replay-<i>` wherever it sits in the request id (vLLM's
  completions API makes it `cmpl-replay-7-0-1a2b3c4d`), else the integer after the last `-`,
  looked up among the trace's timed records in arrival order; the frontend's own suffix
  (`replay-7-1a2b3c4d`) is skipped.
- `prefix`: the unused record whose prompt block hashes share the longest prefix with the
  request's prompt (consume-once), for traffic that does not carry replay ids.
"""

from __future__ import annotations

import logging
import re
from ..engine.plan import RequestPlan
from ..engine.types import EngineCoreRequest, FinishReason
from ..trace.block_hash import prompt_block_hashes
from ..trace.io import read_trace
from ..trace.schema import TraceRecord, replay_subset

logger = logging.getLogger("vllm_vcr.trace")
_REPLAY_ID = re.compile(r"(?:^|-)replay-(\d+)(?:-|$)")

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
           "error": FinishReason.ERROR, "repetition": FinishReason.REPETITION}


def request_index(request: EngineCoreRequest) -> int | None:
    """The replay index carried by a request id (external id first, then the internal one)."""
    for rid in (request.external_req_id, request.request_id):
        if not rid:
            continue
        m = _REPLAY_ID.search(rid)
        if m:  # replay-arrivals' id; vLLM wraps it (`cmpl-replay-7-0-<suffix>`: -0 is the prompt index)
            return int(m.group(1))
        parts = rid.split("-")
        for part in reversed(parts[-2:]):  # `replay-7` or `replay-7-<frontend suffix>`
            if part.isdigit():
                return int(part)
    return None


class RecordMatcher:
    def __init__(self, records: list[TraceRecord], mode: str, block_size: int) -> None:
        if mode not in ("index", "prefix"):
            raise ValueError(f"--replay-match must be index or prefix, got {mode!r}")
        self.mode = mode
        self.block_size = block_size
        self.records = replay_subset(records) if mode == "index" else list(records)
        if mode == "index" and not self.records:
            self.records = list(records)  # untimed traces still replay in file order
        self._unused = set(range(len(self.records)))

    def match(self, request: EngineCoreRequest) -> TraceRecord | None:
        if self.mode == "index":
            i = request_index(request)
            if i is None or not 0 <= i < len(self.records):
                return None
            return self.records[i]
        hashes = prompt_block_hashes(request.prompt_token_ids or [], self.block_size) or []
        best, best_len = None, 0
        for i in self._unused:
            rec_hashes = self.records[i].block_hashes or []
            n = _common_prefix(hashes, rec_hashes)
            if n > best_len or (n == best_len and best is not None and n and i < best):
                best, best_len = i, n
        if best is None:
            return None
        self._unused.discard(best)
        return self.records[best]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TracePlanner:
    """The engine's planner for `--replay-tokens` and/or `--replay-steps`."""

    def __init__(self, tokens: RecordMatcher | None, steps: RecordMatcher | None) -> None:
        self.tokens = tokens
        self.steps = steps

    def __call__(self, request: EngineCoreRequest) -> RequestPlan | None:
        plan = RequestPlan()
        found = False
        if self.tokens is not None:
            rec = self.tokens.match(request)
            if rec is not None and rec.output_token_ids is not None:
                plan.token_ids = list(rec.output_token_ids)
                plan.finish_reason = _FINISH.get(rec.finish_reason or "length", FinishReason.LENGTH)
                found = True
        if self.steps is not None:
            rec = self.steps.match(request)
            if rec is not None and rec.itl_ms is not None:
                plan.ttft = rec.ttft_ms / 1e3
                plan.first_chunk_tokens = rec.first_chunk_tokens()
                plan.steps = [(g / 1e3, k) for g, k in zip(rec.itl_ms, rec.gap_tokens())]
                found = True
        if not found:
            logger.warning("request %s matched no recorded request; generating it normally", request.request_id)
            return None
        return plan


def build_planner(replay_tokens: str | None, replay_steps: str | None, match: str = "index",
                  block_size: int = 16) -> TracePlanner | None:
    def matcher(path: str | None, need: str) -> RecordMatcher | None:
        if not path:
            return None
        trace = read_trace(path)
        usable = [r for r in trace.records if getattr(r, need) is not None]
        if not usable:
            raise ValueError(f"{path}: no record has {need}; it cannot drive this replay")
        bs = (trace.meta.block_size if trace.meta and trace.meta.block_size else None) or block_size
        return RecordMatcher(trace.records, match, bs)

    if not replay_tokens and not replay_steps:
        return None
    return TracePlanner(matcher(replay_tokens, "output_token_ids"), matcher(replay_steps, "itl_ms"))

