"""Simulated KV transfers for prefill/decode disaggregation (vLLM's NixlConnector semantics).

A decode request carrying `do_remote_prefill` pulls its prompt's KV instead of computing it.
Transfers share the link: each active transfer gets bandwidth / n (processor sharing), so two
concurrent pulls take twice as long as one. A prefill request carrying `do_remote_decode`
finishes after its prefill and holds its blocks until the decode side has pulled them, or until
a timeout frees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .core import EngineCore

# Dynamo-style handoff metadata a request may carry inside kv_transfer_params
HANDOFF_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "handoff_id")


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
                        tp_size: int = 1, request_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The kv_transfer_params a prefill instance returns for the decode side (vLLM NIXL keys).

    Handoff identity the request carried (bootstrap room, handoff id) is echoed back so a router
    can match the answer to its session."""
    echoed = {k: request_params[k] for k in HANDOFF_KEYS if request_params and k in request_params}
    return {**echoed,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    }


def has_handoff_metadata(params: dict[str, Any] | None) -> bool:
    return bool(params) and any(params.get(k) is not None for k in HANDOFF_KEYS)


def handoff_error(worker_type: str, params: dict[str, Any]) -> str | None:
    """Why a request's handoff metadata cannot be served here (Dynamo mocker's texts), or None."""
    if params.get("handoff_id") is None:
        if worker_type == "aggregated":
            return None  # bootstrap info without a handoff id is a plain request on an aggregated worker
        return "disaggregated mocker requires a handoff ID"
    if worker_type == "aggregated":
        return "aggregated mocker request cannot carry handoff metadata"
    room = params.get("bootstrap_room")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 1 << 64:
        return f"handoff metadata requires an unsigned 64-bit bootstrap_room, got {room!r}"
    port = params.get("bootstrap_port")
    if worker_type == "decode" and (not isinstance(params.get("bootstrap_host"), str) or not params["bootstrap_host"]
                                    or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        return "decode handoff metadata requires bootstrap_host and bootstrap_port"
    return None


class HandoffObserver(Protocol):
    """The network side of a bootstrap handoff, told about a handoff request's life.

    Every call comes from the engine loop and must not block. `arrived` accepts (None) or rejects
    (the error text) a request; each accepted request later gets exactly one `ended`, when the
    engine holds nothing more for it (finished, aborted, or its prefill blocks released)."""

    def arrived(self, core: "EngineCore", request_id: str, params: dict[str, Any]) -> str | None: ...

    def prefilled(self, core: "EngineCore", request_id: str, params: dict[str, Any]) -> None:
        """Prefill side: the KV is computed and held for the decode side."""

    def ended(self, core: "EngineCore", request_id: str) -> None: ...
