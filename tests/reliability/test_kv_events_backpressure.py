"""A KV-event subscriber that connects and never reads: the publisher drops at its high-water
mark instead of blocking, so the engine is not slowed and the process's memory stays bounded
(by hwm batches queued for the subscriber plus buffer_steps batches kept for replay)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import zmq

from tests.conftest import scaled

from .soak import rss_mb, soak


def test_stuck_subscriber_neither_slows_the_engine_nor_grows_memory(serve_harness, tmp_path):
    pub_port = serve_harness.free_port()
    ctl_port = serve_harness.free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub_port}",
           "topic": "kv", "hwm": 2000, "buffer_steps": 2000}
    sp = serve_harness.ServeProcess(["--inter-token-latency", "1", "--time-to-first-token", "1",
                                     "--kv-events-config", json.dumps(cfg), "--block-size", "16",
                                     "--control-address", f"127.0.0.1:{ctl_port}"],
                                    log_path=tmp_path / "serve.log").wait_ready()
    ctx = zmq.Context()
    stuck = None
    try:
        asyncio.run(soak(sp.url, 300, 100, cut_fraction=0, seed=3))  # warm-up, nobody listening
        t0 = time.perf_counter()
        base = asyncio.run(soak(sp.url, 600, 100, cut_fraction=0, seed=4))
        t_base = time.perf_counter() - t0
        rss_base = rss_mb(sp.proc.pid)

        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.3)  # the subscription reaches the publisher; from now on nobody reads
        t0 = time.perf_counter()
        rounds = [asyncio.run(soak(sp.url, 600, 100, cut_fraction=0, seed=5 + k)) for k in range(3)]
        t_stuck = (time.perf_counter() - t0) / 3
        rss_stuck = rss_mb(sp.proc.pid)
        assert not base.bad and not any(r.bad for r in rounds)
        print(f"kv events: {t_base:.2f}s per 600 requests without a subscriber, {t_stuck:.2f}s with one that "
              f"never reads; RSS {rss_base:.1f} -> {rss_stuck:.1f} MB")
        assert t_stuck < 2.5 * t_base + scaled(2.0)
        assert rss_stuck - rss_base < 60
        stats = httpx.get(f"http://127.0.0.1:{ctl_port}/stats").json()
        assert stats["requests_completed"] >= 2100
    finally:
        if stuck is not None:
            stuck.close(linger=0)
        ctx.term()
        assert sp.stop() == 0
