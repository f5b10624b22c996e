"""KV cache events in vLLM's wire layout (vllm/distributed/kv_events.py, 0.32 and 0.33).

A batch is a msgpack *array* `[ts, [event, ...], data_parallel_rank]`; each event is a msgpack
*map* tagged `"type": <class name>`, with defaulted fields left out when at their default.
The structs below declare vLLM 0.33's fields in its order. The one 0.33-only field
(`BlockStored.lookahead_token_ids`) is None here, so it is never encoded and 0.32 consumers see
exactly their layout; 0.32 decoders would ignore it anyway (unknown map keys are skipped).
"""

from __future__ import annotations

import os
from typing import Any, Sequence, Union

import msgspec

from ..engine.block_hash import event_extra_keys, external_block_hash

ExternalBlockHash = Union[int, bytes]  # low-64 int by default, raw digest if the env var is 0


def use_int_block_hashes() -> bool:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default 1 in 0.32 and 0.33)."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events; the tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]  # the tokens of these blocks, flattened
    block_size: int
    lora_id: int | None  # deprecated in vLLM, still always sent
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # one untagged entry (tuple or None) per block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None  # 0.33 only


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[KVEvent]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a PUB/replay payload (works for batches from real vLLM engines too)."""
    return _decoder.decode(payload)


class KVEventCollector:
    """Collects one engine step's events from block-pool hooks; the engine drains it per step.

    Matches what vLLM's BlockPool emits: one BlockStored per call of `stored` (hashes converted
    to the external form), one BlockRemoved *per evicted hash*, AllBlocksCleared on reset, all
    with `group_idx=0` (one KV cache group) and `medium="GPU"`.
    """

    __slots__ = ("_events", "use_int_hashes", "medium", "group_idx")

    def __init__(self, use_int_hashes: bool | None = None, medium: str = MEDIUM_GPU,
                 group_idx: int | None = 0) -> None:
        self._events: list[KVEvent] = []
        # read once, like vLLM's envs cache: the form must not change mid-run
        self.use_int_hashes = use_int_block_hashes() if use_int_hashes is None else use_int_hashes
        self.medium = medium
        self.group_idx = group_idx

    def stored(self, block_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
               block_size: int, lora_name: str | None = None, *, lora_id: int | None = None,
               extra_keys: Sequence[tuple | None] | None = None,
               session_id: str | None = None) -> None:
        """Blocks newly cached for one request, in chain order; `parent` is the hash before them.

        `extra_keys` are the per-block *tagged* keys the hashes were computed with
        (`block_hash.block_extra_keys`); without them each block gets the LoRA name only, which
        is exact unless a cache salt or mm item touched these blocks.
        """
        n = len(block_hashes)
        if n == 0:
            return
        use_int = self.use_int_hashes
        if extra_keys is None:
            ek: list | None = [(lora_name,) if lora_name else None] * n
        else:
            ek = event_extra_keys(list(extra_keys))
        self._events.append(BlockStored(
            block_hashes=[external_block_hash(h, use_int) for h in block_hashes],
            parent_block_hash=None if parent is None else external_block_hash(parent, use_int),
            token_ids=list(token_ids),
            block_size=block_size,
            lora_id=lora_id,
            medium=self.medium,
            lora_name=lora_name,
            extra_keys=ek,
            group_idx=self.group_idx,
            session_id=session_id,
        ))

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        use_int = self.use_int_hashes
        for h in block_hashes:
            self._events.append(BlockRemoved(
                block_hashes=[external_block_hash(h, use_int)], medium=self.medium,
                group_idx=self.group_idx))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVCacheEvent",
    "KVEvent", "KVEventBatch", "KVEventCollector", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE",
    "decode_batch", "encode_batch", "use_int_block_hashes",
]
