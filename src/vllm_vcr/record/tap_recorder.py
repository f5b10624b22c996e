"""What the engine-core tap learns from the frames it relays, turned into trace records.

No sockets here: `on_add` / `on_abort` / `on_outputs` are fed decoded frames and their arrival
times, so the rules can be tested without ZMQ. The rules (same as the Rust tap):

* ADD starts tracking: concurrency = tracked requests + 1, block hashes of the prompt.
* ABORT from the frontend, an ABORT finish, or an id in `finished_requests` that never finished
  through an output drops the request: aborted requests are not in the trace.
* Each output message: `step_running` = its scheduler stats' `num_running_reqs` (else the tap's
  in-flight count); `step_prefill` = prompt tokens of the requests getting their first token in
  this message (remote-prefill requests excluded). The first token-bearing output sets TTFT;
  each later one appends one gap (gap_ms, tokens, max(step_running, 1), step_prefill).
* `cached_tokens` = local + external cached tokens of the first `prefill_stats`.
* Outputs are read positionally from the untyped msgpack, so any vLLM layout with the documented
  leading positions works, and the scheduler stats reach the sidecar verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.types import EngineCoreRequest
from ..trace.block_hash import prompt_block_hashes
from ..trace.schema import ItlCtx, TraceRecord

_FINISH = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}
# EngineCoreOutput positions (vllm-protocol.md §4.2)
_O_ID, _O_TOKENS, _O_FINISH, _O_PREFILL_STATS = 0, 1, 5, 11
# EngineCoreOutputs positions (§4.1)
_E_OUTPUTS, _E_STATS, _E_FINISHED = 1, 2, 5


@dataclass
class _Tracked:
    arrival: float
    prompt_tokens: int
    concurrency: int
    block_hashes: list[int] | None
    mm_hashes: list[str] | None
    remote_prefill: bool
    t_first: float | None = None
    t_last: float | None = None
    first_tokens: int = 0
    cached: int = 0
    gaps: list[float] = field(default_factory=list)
    gap_tokens: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    token_ids: list[int] | None = None


def _mm_hashes(features: Any) -> list[str] | None:
    out = []
    for f in features or ():
        h = f.get("mm_hash") if isinstance(f, dict) else getattr(f, "mm_hash", None)
        if isinstance(h, str):
            out.append(h)
    return out or None


class TapRecorder:
    def __init__(self, block_size: int = 16, record_tokens: bool = False):
        self.block_size = block_size
        self.record_tokens = record_tokens
        self.t0: float | None = None  # capture start: the first ADD's arrival
        self.tracked: dict[str, _Tracked] = {}
        self.dropped = 0

    # -- inputs ---------------------------------------------------------------------------------

    def on_add(self, req: EngineCoreRequest, t: float) -> None:
        if self.t0 is None:
            self.t0 = t
        ids = req.prompt_token_ids or []
        kv = req.kv_transfer_params or {}
        self.tracked[req.request_id] = _Tracked(
            arrival=t, prompt_tokens=len(ids), concurrency=len(self.tracked) + 1,
            block_hashes=prompt_block_hashes(ids, self.block_size),
            mm_hashes=_mm_hashes(req.mm_features),
            remote_prefill=bool(isinstance(kv, dict) and kv.get("do_remote_prefill")),
            token_ids=[] if self.record_tokens else None,
        )

    def on_abort(self, ids: list[str]) -> None:
        for rid in ids:
            if self.tracked.pop(rid, None) is not None:
                self.dropped += 1

    # -- outputs --------------------------------------------------------------------------------

    def on_outputs(self, envelope: Any, t: float) -> list[TraceRecord]:
        """Apply one output message; returns the records of requests it finished."""
        if not isinstance(envelope, (list, tuple)) or len(envelope) <= _E_OUTPUTS:
            return []
        outs = [o for o in (envelope[_E_OUTPUTS] or ()) if isinstance(o, (list, tuple)) and o]
        stats = envelope[_E_STATS] if len(envelope) > _E_STATS else None
        running = stats.get("num_running_reqs") if isinstance(stats, dict) else None
        step_running = running if isinstance(running, int) else len(self.tracked)
        step_prefill = 0
        for o in outs:
            st = self.tracked.get(o[_O_ID])
            toks = o[_O_TOKENS] if len(o) > _O_TOKENS else None
            if st is not None and st.t_first is None and toks and not st.remote_prefill:
                step_prefill += st.prompt_tokens
        done: list[TraceRecord] = []
        for o in outs:
            rid = o[_O_ID]
            st = self.tracked.get(rid)
            if st is None:
                continue
            toks = o[_O_TOKENS] if len(o) > _O_TOKENS and isinstance(o[_O_TOKENS], list) else []
            ps = o[_O_PREFILL_STATS] if len(o) > _O_PREFILL_STATS else None
            if isinstance(ps, dict) and st.t_first is None:
                st.cached = int(ps.get("num_local_cached_tokens", 0) or 0) + int(
                    ps.get("num_external_cached_tokens", 0) or 0)
            if toks:
                if st.t_first is None:
                    st.t_first = t
                    st.first_tokens = len(toks)
                else:
                    st.gaps.append((t - st.t_last) * 1e3)
                    st.gap_tokens.append(len(toks))
                    st.running.append(max(step_running, 1))
                    st.prefill.append(step_prefill)
                st.t_last = t
                if st.token_ids is not None:
                    st.token_ids.extend(int(x) for x in toks)
            fin = o[_O_FINISH] if len(o) > _O_FINISH else None
            if fin is not None:
                del self.tracked[rid]
                rec = self._record(st, _FINISH.get(fin, "stop"))
                if rec is None:
                    self.dropped += 1
                else:
                    done.append(rec)
        finished = envelope[_E_FINISHED] if len(envelope) > _E_FINISHED else None
        for rid in finished or ():
            if self.tracked.pop(rid, None) is not None:  # finished without a final output: abort
                self.dropped += 1
        return done

    def _record(self, st: _Tracked, finish: str) -> TraceRecord | None:
        if finish == "abort" or st.t_first is None:
            return None
        output = st.first_tokens + sum(st.gap_tokens)
        return TraceRecord(
            prompt_tokens=st.prompt_tokens, cached_tokens=st.cached, output_tokens=output,
            ttft_ms=round((st.t_first - st.arrival) * 1e3, 6),
            itl_ms=[round(g, 6) for g in st.gaps] if st.gaps or output > 1 else None,
            itl_tokens=list(st.gap_tokens) if any(n != 1 for n in st.gap_tokens) else None,
            concurrency=st.concurrency,
            arrival_ms=round((st.arrival - (self.t0 or st.arrival)) * 1e3, 6),
            itl_ctx=ItlCtx(num_running=st.running, prefill_tokens=st.prefill)
            if st.gaps or output > 1 else None,
            block_hashes=st.block_hashes, mm_hashes=st.mm_hashes,
            output_token_ids=st.token_ids, finish_reason=finish,
            remote_prefill=True if st.remote_prefill else None,
        )

    def step_stats_line(self, envelope: Any, t: float) -> dict[str, Any] | None:
        """The sidecar line for a message that carried scheduler stats (verbatim)."""
        if not isinstance(envelope, (list, tuple)) or len(envelope) <= _E_STATS:
            return None
        stats = envelope[_E_STATS]
        if not isinstance(stats, dict):
            return None
        return {"ts_ms": round((t - (self.t0 if self.t0 is not None else t)) * 1e3, 6),
                "scheduler": stats}
