"""A stream's chunks from its template are the bytes the plain path makes: the chunk as a dict,
encoded whole (any id, model or fingerprint text: quotes, backslashes, control characters,
non-ASCII, `%` signs)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_vcr.http.serving_base import encode
from vllm_vcr.openai.chunks import CHAT_CHUNK, COMPLETION_CHUNK, ChunkTemplate
from vllm_vcr.openai.completion import usage_dict

objects = st.sampled_from([CHAT_CHUNK, COMPLETION_CHUNK])
texts = st.text()


def _plain(rid, obj, created, model, rest, fp):
    chunk = {"id": rid, "object": obj.decode(), "created": created, "model": model, **rest}
    if fp is not None:
        chunk["system_fingerprint"] = fp
    return b"data: " + encode(chunk) + b"\n\n"


@given(rid=texts, model=texts, fp=st.none() | texts, created=st.integers(0, 2**40),
       prompt=st.integers(0, 10**6), completion=st.integers(0, 10**6), obj=objects)
def test_usage_chunks_from_the_template_are_the_plain_bytes(rid, model, fp, created, prompt, completion, obj):
    tpl = ChunkTemplate(obj, rid, created, model, fp)
    usage = usage_dict(prompt, completion, None)
    plain = _plain(rid, obj, created, model,
                   {"choices": [], "usage": {k: v for k, v in usage.items() if v is not None}}, fp)
    assert tpl.usage_chunk(usage) == plain
    assert tpl.usage_counts_format() % (prompt, prompt + completion, completion) == plain


@given(rid=texts, model=texts, fp=st.none() | texts, created=st.integers(0, 2**40), obj=objects,
       index=st.integers(0, 100), text=texts, last=st.booleans())
def test_choice_chunks_from_the_template_are_the_plain_bytes(rid, model, fp, created, obj, index, text, last):
    tpl = ChunkTemplate(obj, rid, created, model, fp)
    choice = {"index": index, "text": text, "logprobs": None}
    plain = _plain(rid, obj, created, model, {"choices": [choice]}, fp if last else None)
    assert tpl.chunk(choice, last=last) == plain
    # a head joined by hand (the fast path's way) is the same prefix
    head = tpl.choice(index) + b',"text":' + encode(text) + b',"logprobs":null}]' + (tpl.fingerprint if last else b"")
    assert head + b"}\n\n" == plain
