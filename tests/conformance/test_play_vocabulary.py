"""`vllm-vcr play MODEL` draws output ids from the model's own vocabulary, and without a model from
1000-1999 (ids every vocabulary has): through the real 0.32 and 0.33 frontends on the 4,096-token
tiny model, every streamed token arrives as text, none detokenizes to nothing."""

from __future__ import annotations

import httpx
import pytest

from . import peers
from .test_differential import post

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="module", params=["model", "no-model"])
def stack(request, vllm_version):
    play_args = [str(peers.MODEL_DIR)] if request.param == "model" else []
    st = peers.start_stack(vllm_version, play_args=play_args, vocab_size=None)
    yield request.param, st
    st.stop()


def _detokenize(st, ids: list[int]) -> list[str]:
    with httpx.Client(timeout=30) as c:
        return [c.post(f"{st.base_url}/detokenize", json={"model": st.model, "tokens": [i]}).json()["prompt"]
                for i in ids]


def test_a_10_token_stream_arrives_as_10_content_tokens(stack):
    kind, st = stack
    body = {"model": st.model, "prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    status, events = post(st.base_url, "/v1/completions", body)
    assert status == 200, events
    chunks = [e for e in events if e != "[DONE]" and e.get("choices")]
    ids = [t for e in chunks for t in (e["choices"][0].get("token_ids") or [])]
    usage = next(e["usage"] for e in events if e != "[DONE]" and e.get("usage"))
    assert usage["completion_tokens"] == 10 and len(ids) == 10, (usage, ids)
    texts = _detokenize(st, ids)
    assert all(texts), f"ids that detokenize to nothing: {[i for i, t in zip(ids, texts) if not t]}"
    assert "".join(e["choices"][0]["text"] for e in chunks) == "".join(texts)
    if kind == "no-model":
        assert all(1000 <= i < 2000 for i in ids), ids
        assert st.play.tail(400).count("output token ids are drawn from 1000-1999") == 1
    else:
        assert f"output token ids from [0, {peers.VOCAB_SIZE}) of MODEL" in st.play.tail(400)
