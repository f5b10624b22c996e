"""SubscribeKvEvents: the engine's ZMQ KV-event batches (kv_events/publisher.py, vLLM's wire) relayed
as smg-grpc-proto KvEventBatch messages, one stream over every DP rank's publisher, as the vLLM
servicer relays them: block hashes as the proto's signed 64-bit identity (an integer hash's 64-bit
pattern, a raw digest's last eight bytes), each store's blocks cut from its flattened token ids.

A subscriber gets the batches published from its subscription on (live events); a
`start_sequence_number` skips the batches numbered below it (the publisher's replay buffer is
not read).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import zmq
import zmq.asyncio
from smg_grpc_proto.generated import common_pb2

from ..kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

_U64 = (1 << 64) - 1
_TIER = {"GPU": common_pb2.KV_CACHE_TIER_DEVICE, "CPU": common_pb2.KV_CACHE_TIER_HOST,
         "STORAGE": common_pb2.KV_CACHE_TIER_DISK}
_CACHE_LEVEL = {common_pb2.KV_CACHE_TIER_DEVICE: 0, common_pb2.KV_CACHE_TIER_HOST: 1,
                common_pb2.KV_CACHE_TIER_DISK: 2}


def fold_hash(value: Any) -> int:
    """A block hash as a signed 64-bit integer (the proto's int64)."""
    if isinstance(value, (bytes, bytearray)):
        value = int.from_bytes(bytes(value)[-8:], "big")
    masked = int(value) & _U64
    return masked - (1 << 64) if masked >= 1 << 63 else masked


def _extra_key(key: Any) -> Any:
    if isinstance(key, str):
        return common_pb2.KvBlockExtraKey(text=key)
    if isinstance(key, (bytes, bytearray)):
        return common_pb2.KvBlockExtraKey(blob=bytes(key))
    if isinstance(key, int):
        return common_pb2.KvBlockExtraKey(number=key)
    return None


def event_proto(event: Any, event_id: int) -> Any:
    """One engine KV event as a KvCacheEvent (None for one the proto has no form of)."""
    if isinstance(event, BlockStored):
        tier = _TIER.get(event.medium or "GPU", common_pb2.KV_CACHE_TIER_DEVICE)
        width = event.block_size
        blocks = []
        for i, h in enumerate(event.block_hashes):
            block = common_pb2.KvBlock(block_hash=fold_hash(h), token_ids=event.token_ids[i * width:(i + 1) * width],
                                       block_size=width, cache_level=_CACHE_LEVEL[tier])
            if event.lora_id is not None:
                block.lora_id = event.lora_id
            keys = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
            for key in keys or ():
                proto = _extra_key(key)
                if proto is not None:
                    block.extra_keys.append(proto)
            blocks.append(block)
        stored = common_pb2.KvBlocksStored(blocks=blocks, tier=tier, locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = fold_hash(event.parent_block_hash)
        for name in ("medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "ownership",
                     "session_id", "lora_name"):
            value = getattr(event, name, None)
            if value is not None:
                setattr(stored, name, value)
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        tier = _TIER.get(event.medium or "GPU", common_pb2.KV_CACHE_TIER_DEVICE)
        removed = common_pb2.KvBlocksRemoved(block_hashes=[fold_hash(h) for h in event.block_hashes], tier=tier,
                                             cache_level=_CACHE_LEVEL[tier],
                                             locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
        for name in ("medium", "group_idx", "ownership"):
            value = getattr(event, name, None)
            if value is not None:
                setattr(removed, name, value)
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    if isinstance(event, AllBlocksCleared):
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    return None


def batch_proto(seq: int, payload: bytes, rank: int, next_id: list[int]) -> Any:
    batch = decode_batch(payload)
    events = []
    for event in batch.events:
        next_id[0] += 1
        proto = event_proto(event, next_id[0])
        if proto is not None:
            events.append(proto)
    return common_pb2.KvEventBatch(sequence_number=seq, timestamp=batch.ts, events=events,
                                   dp_rank=batch.data_parallel_rank if batch.data_parallel_rank is not None
                                   else rank)


def _dialable(endpoint: str) -> str:
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


async def relay(endpoints: list[tuple[int, str]], topic: str, start_seq: int = 0) -> AsyncIterator[Any]:
    """KvEventBatch messages from the publishers at `endpoints` ((rank, endpoint) pairs), until the
    caller stops reading."""
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    for _rank, endpoint in endpoints:
        sub.connect(_dialable(endpoint))
    ranks = {i: rank for i, (rank, _) in enumerate(endpoints)}
    next_id = [0]
    try:
        while True:
            frames = await sub.recv_multipart()
            if len(frames) != 3:
                continue
            _topic, seq, payload = frames
            number = int.from_bytes(seq, "big")
            if number < start_seq:
                continue
            yield batch_proto(number, payload, ranks.get(0, 0), next_id)
    finally:
        sub.close(linger=0)
