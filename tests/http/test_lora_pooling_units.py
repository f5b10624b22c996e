"""Unit properties of the LoRA request states and the simulated embeddings (no server)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from vllm_vcr.engine.types import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    SchedulerStats,
)
from vllm_vcr.openai.pooling import embed_tokens, encode_vector
from vllm_vcr.vllm.lora_metrics import LoRARequestStates

EVENTS = [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED]


@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["a", "b", None]),
                          st.sampled_from(["queued", "scheduled", "preempted", "finished", "aborted"])),
                max_size=60))
def test_lora_states_track_each_request_once(steps):
    states = LoRARequestStates(max_loras=2)
    truth: dict[str, tuple[str, bool]] = {}  # rid -> (adapter, running)
    adapters: dict[str, str | None] = {}
    for i, adapter, what in steps:
        rid = f"r{i}"
        if rid not in adapters:
            adapters[rid] = adapter
            lora = LoRARequest(adapter, 1 if adapter == "a" else 2, f"/{adapter}") if adapter else None
            states.on_submit(EngineCoreRequest(request_id=rid, prompt_token_ids=[1], lora_request=lora))
        name = adapters[rid]
        out = EngineCoreOutput(request_id=rid, new_token_ids=[])
        outs = EngineCoreOutputs(outputs=[out], scheduler_stats=SchedulerStats())
        if what in ("queued", "scheduled", "preempted"):
            out.events = [EngineCoreEvent(int(EVENTS[["queued", "scheduled", "preempted"].index(what)]), 0.0)]
            if name:
                truth[rid] = (name, what == "scheduled")
        elif what == "finished":
            out.finish_reason = FinishReason.STOP
            truth.pop(rid, None)
        else:
            outs = EngineCoreOutputs(outputs=[], finished_requests=[rid], scheduler_stats=SchedulerStats())
            truth.pop(rid, None)
        if what in ("finished", "aborted"):
            adapters.pop(rid)  # a finished id is never reused by the engine
        states.on_engine_outputs(0, outs)
        expected: dict[str, tuple[int, int]] = {}
        for n, running in truth.values():
            r, w = expected.get(n, (0, 0))
            expected[n] = (r + running, w + (not running))
        assert states.counts() == expected
    samples = list(states.collect())[0].samples
    assert all(s.labels["max_lora"] == "2" and s.labels["waiting_lora_adapters"] == s.labels["running_lora_adapters"]
               for s in samples)


@given(st.lists(st.integers(0, 5000), max_size=40), st.sampled_from([None, 8, 32]))
def test_embeddings_are_deterministic_unit_vectors(ids, dims):
    a = embed_tokens(ids, 64, dims)
    b = embed_tokens(list(ids), 64, dims)
    assert np.array_equal(a, b) and a.shape == (dims or 64,) and a.dtype == np.float32
    if ids:
        assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5


def test_base64_round_trips():
    import base64

    v = embed_tokens([1, 2, 3], 16)
    assert np.allclose(np.frombuffer(base64.b64decode(encode_vector(v, "base64", "float32", "little")), "<f4"), v)
    assert np.allclose(np.frombuffer(base64.b64decode(encode_vector(v, "base64", "float16", "big")), ">f2"), v,
                       atol=1e-3)
    bf = np.frombuffer(base64.b64decode(encode_vector(v, "base64", "bfloat16", "little")), "<u2")
    assert np.allclose((bf.astype(np.uint32) << 16).view(np.float32), v, atol=1e-2)
    assert encode_vector(v, "float", "float32", "native") == v.tolist()
