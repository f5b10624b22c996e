"""The chat stream's final usage chunk from its template is the bytes final_usage_chunk + msgspec
make (any id, model or fingerprint text, `%` included)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from vllm_vcr.http.serving_base import encode
from vllm_vcr.openai.chat import ChatStream
from vllm_vcr.openai.completion import final_usage_chunk, usage_dict


@given(rid=st.text(), model=st.text(), fp=st.none() | st.text(), created=st.integers(0, 2**40),
       prompt=st.integers(0, 10**6), completion=st.integers(0, 10**6))
def test_the_usage_template_renders_final_usage_chunks_bytes(rid, model, fp, created, prompt, completion):
    stream = SimpleNamespace(rid=rid, model=model, fp=fp, created=created)
    fast = ChatStream._usage_template(stream) % (prompt, prompt + completion, completion)
    full = b"data: " + encode(final_usage_chunk(rid, "chat.completion.chunk", created, model,
                                                usage_dict(prompt, completion, None), fp)) + b"\n\n"
    assert fast == full
