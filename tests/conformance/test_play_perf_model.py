"""`play --perf-model aic` behind the real vLLM frontend: the frontend learns the KV cache size the
GPU would have (its own `vllm:cache_config_info`), and under rising concurrency the streams it
serves slow down as the estimator prices bigger decode batches."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from ..perf.conftest import LLAMA_8B, needs_aic
from . import peers

pytestmark = [pytest.mark.conformance, needs_aic]

GPU = "h100_sxm"
MAX_TOKENS = 300  # streams long enough to overlap although the frontend admits them one by one
PROMPT = "hello " * 466  # 1400 tokens of the tiny model: long contexts make big batches slow
PROMPT_TOKENS = 1400


@pytest.fixture(scope="module")
def stack(vllm_version):
    st = peers.start_stack(vllm_version, frontend_args=["--max-model-len", "2048"],
                           play_args=["--model-name", LLAMA_8B, "--perf-model", "aic", "--gpu", GPU])
    yield st
    st.stop()


async def _tpot(c: httpx.AsyncClient, st) -> float | None:
    """Seconds per output token over the middle third of a stream (when every stream of the
    round is decoding), from the token counts the frontend puts in each chunk; None when one
    chunk carried the whole middle third (a frontend behind its engine merges tokens)."""
    body = {"model": st.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    marks: dict[int, tuple[float, int]] = {}  # third -> (time, tokens) of the first chunk past it
    async with c.stream("POST", st.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                for third in (1, 2):
                    if tokens >= third * MAX_TOKENS // 3 and third not in marks:
                        marks[third] = (time.perf_counter(), tokens)
    (t1, n1), (t2, n2) = marks[1], marks[2]
    return (t2 - t1) / (n2 - n1) if n2 > n1 else None


async def _median_tpot(st, concurrency: int, rounds: int = 2) -> float:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as c:
        values = []
        for _ in range(rounds):
            values += await asyncio.gather(*(_tpot(c, st) for _ in range(concurrency)))
    measured = [v for v in values if v is not None]
    assert len(measured) * 2 >= len(values), f"{len(values) - len(measured)} of {len(values)} streams unmeasurable"
    return statistics.median(measured)


def _decode_step_ms(batch: int, context: int) -> float:
    """The perf model's decode step at this batch size, host overhead included."""
    from vllm_vcr.engine.step import StepBatch
    from vllm_vcr.perf.aic import AicTarget, step_latency

    step = StepBatch(num_decodes=batch, num_prefill_tokens=0, num_prefills=0, num_first_tokens=0,
                     decode_context=batch * context)
    return step_latency(AicTarget(LLAMA_8B, GPU, async_scheduling=True)).step_ms(step)  # play's default


def test_frontend_sees_the_gpu_kv_cache(stack):
    metrics = httpx.get(stack.base_url + "/metrics", timeout=10).text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:cache_config_info"))
    blocks = int(line.split('num_gpu_blocks="')[1].split('"')[0])
    assert blocks > 20_000  # ~400k tokens of an 8B model on 80 GB, not the default 1024 blocks


def test_tpot_rises_with_concurrency_as_the_estimator_says(stack):
    context = PROMPT_TOKENS + MAX_TOKENS // 2
    step_1, step_64 = _decode_step_ms(1, context), _decode_step_ms(64, context)
    assert step_64 > 1.5 * step_1  # what the test relies on: bigger batches are slower on the GPU
    tpot_1 = asyncio.run(_median_tpot(stack, 1, rounds=3)) * 1e3
    tpot_64 = asyncio.run(_median_tpot(stack, 64)) * 1e3
    # one stream: the modelled step, which the client and the frontend may only lengthen
    assert tpot_1 >= 0.95 * step_1, (tpot_1, step_1)
    # 64 streams: the frontend admits them one by one (tokenizing each prompt), so even in the
    # middle third of each stream the batch is not always all 64: no absolute bound here
    # and the slow-down shows through the real frontend: at least half the estimator's
    assert tpot_64 / tpot_1 >= 1 + 0.5 * (step_64 / step_1 - 1), (tpot_1, tpot_64, step_1, step_64)
