"""The publisher on real ZMQ sockets (127.0.0.1 and ipc only).

Every wait is a bounded poll on a socket or a condition with a deadline; nothing asserts on
time slept. The publisher's wire behaviour (frames, seq, replay reply and end marker) was also
compared live against vLLM 0.32's own ZmqEventPublisher with the same subscriber code.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from vllm_vcr.kv_events import (
    END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventCollector, KVEventPublisher,
    KVEventsConfig, decode_batch,
)
from tests.conftest import scaled

DEADLINE = 10.0  # generous bound for a loaded 2-core box; passing runs take milliseconds


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def publishers():
    made: list[KVEventPublisher] = []
    yield made
    for p in made:
        p.close(timeout=0.5)


def _sub_bound(ctx) -> tuple[zmq.Socket, str]:
    """A SUB bound on 127.0.0.1; the publisher connects to it (vLLM: no '*' means connect)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    return sub, sub.getsockopt_string(zmq.LAST_ENDPOINT)


def _make(publishers, ctx, **cfg) -> KVEventPublisher:
    rank = cfg.pop("_rank", 0)
    cfg.setdefault("enable_kv_cache_events", True)
    pub = KVEventPublisher(KVEventsConfig(**cfg), data_parallel_rank=rank, context=ctx)
    publishers.append(pub)
    return pub


def _removed(i: int) -> list:
    return [BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0)]


def _wait_joined(pub: KVEventPublisher, sub: zmq.Socket) -> int:
    """Publish probes until the subscriber sees one (PUB drops until the peer is connected).

    Returns the seq of the last probe, read off the subscriber: later batches follow it.
    """
    before = pub.stats["published"]
    probes = 0
    deadline = time.monotonic() + scaled(DEADLINE)
    while True:
        assert time.monotonic() < deadline, "subscriber never joined"
        assert pub.publish([AllBlocksCleared()])
        probes += 1
        if sub.poll(50):
            break
    _wait(lambda: pub.stats["published"] == before + probes, "the probes to be sent")
    last = before + probes - 1  # seq counts every batch sent, from 0
    seq = -1
    while seq != last:  # once joined, every later probe arrives, in order
        assert sub.poll(int(DEADLINE * 1000)), "probe lost after joining"
        seq = int.from_bytes(sub.recv_multipart()[1], "big")
    return last


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + scaled(DEADLINE)
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _replay(ctx, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(int(DEADLINE * 1000)), "replay reply timed out"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return out
            out.append(frames)
    finally:
        dealer.close(0)


def test_live_batches_in_vllm_format(ctx, publishers):
    sub, ep = _sub_bound(ctx)
    pub = _make(publishers, ctx, endpoint=ep, topic="kv@127.0.0.1:8000@model", _rank=0)
    assert pub.publisher_config.endpoint == ep  # connect endpoints are reported as given
    first = _wait_joined(pub, sub)

    col = KVEventCollector(use_int_hashes=True)
    for step in range(5):
        col.stored([bytes(24) + (step + 1).to_bytes(8, "big")], None, [step] * 4, 4, None)
        if step % 2:
            col.removed([bytes(24) + step.to_bytes(8, "big")])
        assert pub.publish(col.drain(), ts=1000.0 + step)
    assert pub.publish([]) is False  # an empty step publishes nothing and uses no seq

    got = []
    while len(got) < 5:
        assert sub.poll(int(DEADLINE * 1000))
        got.append(sub.recv_multipart())
    assert all(len(f) == 3 for f in got)
    assert {f[0] for f in got} == {b"kv@127.0.0.1:8000@model"}
    seqs = [int.from_bytes(f[1], "big") for f in got]
    assert seqs == list(range(first + 1, first + 6))
    batches = [decode_batch(f[2]) for f in got]
    assert [b.ts for b in batches] == [1000.0 + i for i in range(5)]
    assert {b.data_parallel_rank for b in batches} == {0}
    assert [type(e).__name__ for e in batches[1].events] == ["BlockStored", "BlockRemoved"]
    stored = batches[3].events[0]
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.token_ids, stored.block_size) == ([4], [3] * 4, 4)
    assert not sub.poll(50)  # the empty publish sent nothing
    sub.close(0)


def test_late_subscriber_recovers_through_replay(ctx, publishers):
    sub, ep = _sub_bound(ctx)
    pub = _make(publishers, ctx, endpoint=ep, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=4,
                topic="t")
    replay_ep = pub.replay_endpoint
    assert replay_ep.startswith("tcp://127.0.0.1:") and not replay_ep.endswith(":0")
    first = _wait_joined(pub, sub)
    sub.close(0)  # the subscriber goes away and misses the next batches

    for i in range(6):
        pub.publish(_removed(i))
    _wait(lambda: pub.stats["published"] == first + 1 + 6, "batches to be published")

    # buffer_steps=4: only the last 4 batches are kept
    last = first + 6
    frames = _replay(ctx, replay_ep, 0)
    assert [int.from_bytes(f[2], "big") for f in frames] == list(range(last - 3, last + 1))
    assert all(f[0] == b"" and f[1] == b"t" for f in frames)
    assert [decode_batch(f[3]).events[0].block_hashes for f in frames] == [[2], [3], [4], [5]]

    # a gap detected from a later live seq is recovered from that point on
    frames = _replay(ctx, replay_ep, last - 1)
    assert [int.from_bytes(f[2], "big") for f in frames] == [last - 1, last]
    assert _replay(ctx, replay_ep, last + 100) == []  # nothing newer: just the end marker
    assert pub.stats["replay_requests"] == 3


def _sub_connected(ctx, ep: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    return sub


def test_bind_on_ipc(ctx, publishers, tmp_path):
    ep = f"ipc://{tmp_path}/kv-pub"
    pub = _make(publishers, ctx, endpoint=ep, replay_endpoint=f"ipc://{tmp_path}/kv-replay")
    assert pub.endpoint == ep  # ipc endpoints are bound, the subscriber connects
    sub = _sub_connected(ctx, ep)
    _wait_joined(pub, sub)
    pub.publish(_removed(9))
    assert sub.poll(int(DEADLINE * 1000))
    _, seq, payload = sub.recv_multipart()
    assert decode_batch(payload).events == _removed(9)
    # replay from the seq just seen returns that very batch
    frames = _replay(ctx, pub.replay_endpoint, int.from_bytes(seq, "big"))
    assert [(f[2], f[3]) for f in frames] == [(seq, payload)]
    sub.close(0)


def test_inproc_rank_suffix_and_batch_rank(ctx, publishers):
    pub = _make(publishers, ctx, endpoint="inproc://kv-events", _rank=2)
    assert pub.endpoint == "inproc://kv-events_dp2"
    sub = _sub_connected(ctx, "inproc://kv-events_dp2")
    _wait_joined(pub, sub)
    pub.publish(_removed(1))
    assert sub.poll(int(DEADLINE * 1000))
    assert decode_batch(sub.recv_multipart()[2]).data_parallel_rank == 2
    sub.close(0)


def test_tcp_port_offset_per_rank(ctx, publishers):
    # a rank-1 publisher configured with port P-1 must dial P (connect mode binds nothing)
    sub, ep = _sub_bound(ctx)
    port = int(ep.rsplit(":", 1)[1])
    pub = _make(publishers, ctx, endpoint=f"tcp://127.0.0.1:{port - 1}", _rank=1)
    assert pub.endpoint == ep
    _wait_joined(pub, sub)
    sub.close(0)


def test_slow_subscriber_never_blocks_publish(ctx, publishers):
    # a subscriber that never reads, with tiny HWMs on both sides
    sub, ep = _sub_bound(ctx)
    sub.setsockopt(zmq.RCVHWM, 1)
    pub = _make(publishers, ctx, endpoint=ep, hwm=1, buffer_steps=10, max_queue_size=100_000)
    _wait_joined(pub, sub)
    before = pub.stats["published"]
    big = [BlockStored(block_hashes=list(range(64)), parent_block_hash=None, token_ids=list(range(1024)),
                       block_size=16, lora_id=None, medium="GPU", lora_name=None)]
    n = 3000
    t0 = time.perf_counter()
    for _ in range(n):
        pub.publish(big)
    elapsed = time.perf_counter() - t0
    # the engine-side call is a queue put; 3000 of them take milliseconds, never a stall
    assert elapsed < scaled(5.0), elapsed
    # and the thread keeps draining even though nobody reads
    _wait(lambda: pub.stats["published"] + pub.stats["dropped"] == before + n, "the queue to drain")
    assert pub.stats["queued"] == 0
    sub.close(0)


def test_full_queue_drops_instead_of_blocking(ctx, publishers, monkeypatch):
    sub, ep = _sub_bound(ctx)
    pub = _make(publishers, ctx, endpoint=ep, max_queue_size=4)
    entered, release = threading.Event(), threading.Event()
    real_send = pub._send

    def stalled_send(batch):  # the publisher thread stalls inside its first send
        entered.set()
        release.wait(DEADLINE)
        real_send(batch)

    monkeypatch.setattr(pub, "_send", stalled_send)
    assert pub.publish(_removed(0))
    assert entered.wait(DEADLINE)
    results = [pub.publish(_removed(i)) for i in range(1, 11)]
    assert results == [True] * 4 + [False] * 6
    assert pub.stats["dropped"] == 6
    release.set()
    _wait(lambda: pub.stats["published"] == 5, "the accepted batches")
    sub.close(0)


def test_close_flushes_and_is_idempotent(ctx, publishers):
    sub, ep = _sub_bound(ctx)
    pub = _make(publishers, ctx, endpoint=ep)
    first = _wait_joined(pub, sub)
    for i in range(3):
        pub.publish(_removed(i))
    pub.close(timeout=2.0)
    pub.close()
    assert pub.publish(_removed(99)) is False
    seqs = []
    while len(seqs) < 3 and sub.poll(int(DEADLINE * 1000)):
        seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
    assert seqs == [first + 1, first + 2, first + 3]
    sub.close(0)


def test_busy_address_fails_at_startup(ctx, publishers):
    holder = ctx.socket(zmq.ROUTER)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind("tcp://127.0.0.1:0")
    taken = holder.getsockopt_string(zmq.LAST_ENDPOINT)
    sub, ep = _sub_bound(ctx)
    with pytest.raises(zmq.ZMQError):
        KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=ep, replay_endpoint=taken),
                         context=ctx)
    holder.close(0)
    sub.close(0)
