"""Client-side timing of one streamed response into a trace record.

Gaps are per token-bearing chunk (not per token), like the engine-side tap; a chunk that carried
N > 1 tokens closes its gap with `itl_tokens` N. SSE events that arrive in the same network read
count as one chunk. There is no engine-step context (`itl_ctx`).
"""

from __future__ import annotations

from .schema import FINISH_REASONS, TraceRecord
from .sse import parse_chunk


class ChunkTimer:
    def __init__(self, t_send: float):
        self.t_send = t_send
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.first_tokens = 0
        self.gaps_ms: list[float] = []
        self.gap_tokens: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def on_events(self, events: list[bytes], t: float) -> str | None:
        """Apply the SSE payloads of one network read; the stream's error message, if it sent one."""
        for payload in events:
            info = parse_chunk(payload)
            if info.error:
                return info.error
            self.on_tokens(t, info.tokens)
            if info.finish_reason:
                self.finish_reason = info.finish_reason
            if info.usage:
                self.usage = info.usage
        return None

    def on_tokens(self, t: float, n: int) -> None:
        if n <= 0:
            return
        if t == self.t_last:
            # events that arrived in one read are one chunk to the client: no fake zero gaps
            if self.gap_tokens:
                self.gap_tokens[-1] += n
            else:
                self.first_tokens += n
            return
        if self.t_first is None:
            self.t_first = t
            self.first_tokens = n
        else:
            self.gaps_ms.append((t - self.t_last) * 1e3)
            self.gap_tokens.append(n)
        self.t_last = t

    @property
    def counted_tokens(self) -> int:
        return self.first_tokens + sum(self.gap_tokens)

    def to_record(self, *, prompt_tokens: int | None, arrival_ms: float | None, concurrency: int,
                  block_hashes: list[int] | None = None) -> TraceRecord | None:
        """None when no token ever arrived (nothing to time)."""
        if self.t_first is None:
            return None
        usage = self.usage or {}
        output = self.counted_tokens
        reported = usage.get("completion_tokens")
        if isinstance(reported, int) and reported > output:
            output = reported  # tokens we could not see per chunk land in the first chunk
        if isinstance(usage.get("prompt_tokens"), int):
            prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        multi = any(n != 1 for n in self.gap_tokens)
        finish = self.finish_reason if self.finish_reason in FINISH_REASONS else (
            "stop" if self.finish_reason else None)
        return TraceRecord(
            prompt_tokens=prompt_tokens or 0,
            cached_tokens=cached if isinstance(cached, int) else 0,
            output_tokens=output,
            ttft_ms=round((self.t_first - self.t_send) * 1e3, 6),
            itl_ms=[round(g, 6) for g in self.gaps_ms] if output > 1 or self.gaps_ms else None,
            itl_tokens=list(self.gap_tokens) if multi else None,
            concurrency=max(concurrency, 1),
            arrival_ms=arrival_ms,
            block_hashes=block_hashes,
            finish_reason=finish,
        )
