"""Simulated KV transfers for prefill/decode disaggregation (vLLM's NixlConnector semantics).

A decode request carrying `do_remote_prefill` pulls its prompt's KV instead of computing it.
Transfers share the link: each active transfer gets bandwidth / n (processor sharing), so two
concurrent pulls take twice as long as one. A prefill request carrying `do_remote_decode`
finishes after its prefill and holds its blocks until the decode side has pulled them, or until
a timeout frees them.

`KVTransfer` owns one engine's P/D state (pulls, holds, deferred pulls, bootstrap handoffs) and
its hooks. Adapters (pd/) use its public interface: `add_pulled_listener`,
`remove_pulled_listener`, `set_handoff_observer` (an observer bound to its engine); the engine
core calls the rest from its loop.
"""

from __future__ import annotations

import logging
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from .policy import HandoffOrder
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .config import EngineArgs
    from .kv_cache_manager import KVCacheManager
    from .scheduler import Scheduler

logger = logging.getLogger("vllm_vcr.engine")
_deadline = itemgetter(1)  # of a hold: (request, when it expires)
PulledListener = Callable[[dict[str, Any]], None]

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
        # done: under a nanosecond of link time left (a fast link's last bytes can take less time than
        # the clock's floating-point resolution, so the completion time would never move past now)
        eps = max(1e-6, self.bandwidth * 1e-9)
        done = [rid for rid, left in self.remaining.items() if left <= eps]
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
    """The network side of a bootstrap handoff for one engine, told about a handoff request's life.

    Every call comes from the engine loop and must not block. `arrived` accepts (None) or rejects
    (the error text) a request; each accepted request later gets exactly one `ended`, when the
    engine holds nothing more for it (finished, aborted, or its prefill blocks released)."""

    def arrived(self, request_id: str, params: dict[str, Any]) -> str | None: ...

    def prefilled(self, request_id: str, params: dict[str, Any]) -> None:
        """Prefill side: the KV is computed and held for the decode side."""

    def ended(self, request_id: str) -> None: ...


class KVTransfer:
    """One engine's P/D state: KV pulls in flight and deferred (decode side), blocks held for
    pullers (prefill side), bootstrap handoffs, and the hooks that tell the network side."""

    def __init__(self, args: EngineArgs, engine_index: int, kv: KVCacheManager, scheduler: Scheduler,
                 requests: Mapping[str, Request]) -> None:
        self._kv = kv
        self._scheduler = scheduler
        self._requests = requests  # the engine's live requests, by id
        self._args = args
        self._engine_index = engine_index
        self.transfers = TransferQueue(args.kv_transfer_bandwidth * 1e9 * args.time_scale)
        self.holds: dict[str, tuple[Request, float]] = {}  # request id -> (request, expiry)
        self.handoffs: set[str] = set()  # requests the handoff observer was told about
        # decode requests that have their blocks but pull only once kv_ready() says the KV is there
        self.waits: set[str] = set()
        self._pulled_listeners: list[PulledListener] = []
        self._handoff: HandoffObserver | None = None
        # prefill worker, bootstrap handoffs: the finish each computed request gives once its
        # handoff ends (request id -> (finish reason, stop reason, kv_transfer_params)), and the
        # ones whose handoff ended since the core last looked ((request id, error or None))
        self.parked: dict[str, tuple[Any, Any, dict[str, Any]]] = {}
        self.settled: list[tuple[str, str | None]] = []

    # --- the adapters' interface -------------------------------------------------------------
    def add_pulled_listener(self, listener: PulledListener) -> None:
        """`listener(kv_transfer_params)` runs in the engine step when a pull completes (must not block)."""
        self._pulled_listeners.append(listener)

    def remove_pulled_listener(self, listener: PulledListener) -> None:
        if listener in self._pulled_listeners:
            self._pulled_listeners.remove(listener)

    def set_handoff_observer(self, observer: HandoffObserver | None) -> None:
        self._handoff = observer

    @property
    def handoff_observer(self) -> HandoffObserver | None:
        return self._handoff

    # --- the core's side -----------------------------------------------------------------------
    def next_event(self) -> float | None:
        """When a pull completes or a hold expires next."""
        t = self.transfers.next_completion()
        if self.holds:
            h = min(map(_deadline, self.holds.values()))
            t = h if t is None or h < t else t
        return t

    def admit_handoff(self, req: Request, params: dict[str, Any]) -> str | None:
        """Validate a request's handoff metadata and register it with the network side (error text or None)."""
        wt = self._args.worker_type
        err = handoff_error(wt, params)
        if err is not None or params.get("handoff_id") is None:
            return err
        if self._handoff is None:
            return "source handoff manager is not initialized" if wt == "prefill" else \
                "bootstrap client is not initialized"
        destination_first = wt == "prefill" and \
            self._scheduler.engine_policy.handoff_order is HandoffOrder.DESTINATION_FIRST
        err = self._handoff.arrived(req.request_id, params)
        if err is not None:
            return err
        if destination_first:
            req.status = RequestStatus.BOOTSTRAPPING  # queued once `EngineCore.destination_joined`
        self.handoffs.add(req.request_id)
        if wt == "decode":
            req.remote_prefill = params
            self.waits.add(req.request_id)
        return None

    def end_handoff(self, request_id: str) -> None:
        if request_id in self.handoffs:
            self.handoffs.discard(request_id)
            self.waits.discard(request_id)
            if self._handoff is not None:
                self._handoff.ended(request_id)

    def schedule_pull(self, req: Request, num_tokens: int, now: float) -> None:
        """The scheduler gave a request its blocks for `num_tokens` external tokens: pull them,
        unless the pull waits for kv_ready()."""
        req.external_tokens = num_tokens
        if req.request_id not in self.waits:
            self.start_pull(req, now)

    def start_pull(self, req: Request, now: float) -> None:
        req.transferring = True
        self.transfers.start(req.request_id, req.external_tokens * self._args.kv_bytes_per_token, now)

    def cancel_pull(self, req: Request, now: float) -> None:
        """The request was preempted: its pull restarts when it is scheduled again."""
        if req.transferring:
            self.transfers.cancel(req.request_id, now)
            req.transferring = False

    def pop_pulled(self, now: float) -> list[str]:
        return self.transfers.pop_done(now) if self.transfers.remaining else []

    def complete_pull(self, req: Request) -> None:
        """The KV is here: the prompt counts as computed and the listeners hear of it."""
        req.transferring = False
        req.num_computed_tokens += req.external_tokens
        self._kv.cache_computed_blocks(req)
        for listener in self._pulled_listeners:
            listener(req.remote_prefill)

    def complete_pulls(self, request_ids: list[str], requests: dict[str, Request]) -> list[Request]:
        """The requests (still live and pulling) whose pulls completed: their KV counts as computed."""
        pulled = []
        for rid in request_ids:
            req = requests.get(rid)
            if req is not None and req.transferring:
                self.complete_pull(req)
                pulled.append(req)
        return pulled

    def kv_ready(self, request_id: str, error: str | None, now: float) -> Request | None:
        """A deferred pull may start; returns the request if its handoff failed (the core fails it)."""
        if request_id not in self.waits:
            return None  # finished, aborted, or never deferred
        self.waits.discard(request_id)
        req = self._requests.get(request_id)
        if req is None:
            return None
        if error is not None:
            logger.warning("request %s: KV handoff failed: %s", request_id, error)
            return req
        if req.status is RequestStatus.RUNNING and not req.transferring and not req.output_token_ids:
            self.start_pull(req, now)  # admitted earlier, its blocks were waiting for this
        return None  # still queued: admission starts the pull

    def hold_for_decode(self, req: Request, now: float) -> dict[str, Any]:
        """A prefill-side request finished: hold its blocks for the decode side, return its params."""
        a = self._args
        self.holds[req.request_id] = (req, now + a.kv_hold_timeout / a.time_scale)
        params = prefill_side_params(req.request_id, [b.block_id for b in req.blocks], a.engine_id,
                                     a.side_channel_host, a.side_channel_port + self._engine_index,
                                     request_params=req.kv_transfer_params)
        if req.request_id in self.handoffs and self._handoff is not None:
            self._handoff.prefilled(req.request_id, params)
        return params

    def awaits_handoff(self, req: Request) -> bool:
        """A prefill worker's bootstrap handoff request: its finish waits for the handoff (`park`)."""
        return self._args.worker_type == "prefill" and req.request_id in self.handoffs

    def park(self, req: Request, reason: Any, stop_reason: Any, params: dict[str, Any]) -> None:
        """The request's prefill is done and its KV held: it finishes when its hold is released
        (the decoder pulled: this finish; the handoff failed: an error), see `settled`."""
        self.parked[req.request_id] = (reason, stop_reason, params)

    def release_hold(self, request_id: str, error: str | None = None) -> bool:
        """Free a prefill's held KV: pulled by its decode side, or (`error`) given up on."""
        entry = self.holds.pop(request_id, None)
        if entry is None:
            return False
        self._kv.free(entry[0])
        self._scheduler.admission_blocked = False
        self.end_handoff(request_id)
        if request_id in self.parked:
            self.settled.append((request_id, error))
        return True

    def expire_holds(self, now: float) -> bool:
        """Free the holds whose decode side never pulled; True if any was freed."""
        expired = False
        if min(map(_deadline, self.holds.values()), default=now) > now:
            return False
        for rid in [rid for rid, (_, deadline) in self.holds.items() if deadline <= now]:
            logger.warning("request %s: KV hold expired before the decode side pulled it", rid)
            expired = self.release_hold(rid, "KV hold expired before the decode side pulled it") or expired
        return expired
