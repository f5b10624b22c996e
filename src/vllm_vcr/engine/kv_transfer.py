"""Simulated KV transfers for prefill/decode disaggregation (vLLM's NixlConnector semantics).

A decode request carrying `do_remote_prefill` pulls its prompt's KV instead of computing it.
Transfers share the link: each active transfer gets bandwidth / n (processor sharing), so two
concurrent pulls take twice as long as one. A prefill request carrying `do_remote_decode`
finishes after its prefill and holds its blocks until the decode side has pulled them, or until
a timeout frees them.
"""

from __future__ import annotations

from typing import Any


class TransferQueue:
    """Processor-sharing model of one engine's KV link (bytes per second)."""

    def __init__(self, bandwidth_bytes_per_s: float) -> None:
        self.bandwidth = bandwidth_bytes_per_s
        self.remaining: dict[str, float] = {}  # request id -> bytes left
        self._t = 0.0

    def _advance(self, now: float) -> None:
        n = len(self.remaining)
        if n and now > self._t:
            share = self.bandwidth * (now - self._t) / n
            for rid in self.remaining:
                self.remaining[rid] -= share
        self._t = max(self._t, now)

    def start(self, rid: str, nbytes: float, now: float) -> None:
        self._advance(now)
        self._t = now
        self.remaining[rid] = max(nbytes, 0.0)

    def cancel(self, rid: str, now: float) -> None:
        self._advance(now)
        self.remaining.pop(rid, None)

    def pop_done(self, now: float) -> list[str]:
        self._advance(now)
        done = [rid for rid, left in self.remaining.items() if left <= 1e-6]
        for rid in done:
            del self.remaining[rid]
        return done

    def next_completion(self) -> float | None:
        if not self.remaining:
            return None
        n = len(self.remaining)
        return self._t + min(self.remaining.values()) * n / self.bandwidth


def prefill_side_params(request_id: str, block_ids: list[int], engine_id: str, host: str, port: int,
                        tp_size: int = 1) -> dict[str, Any]:
    """The kv_transfer_params a prefill instance returns for the decode side (vLLM NIXL keys)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    }
