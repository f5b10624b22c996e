"""A chat stream's opening (the role chunk per choice, then any echoed message) made from the role's
delta kept per role (`chat._role_delta`) is byte for byte the chunk written out in full, for
hostile roles, echoed texts, prompt ids, choice counts and usage settings."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.http.serving_base import encode
from vllm_vcr.openai.chat import ChatStream
from vllm_vcr.openai.chunks import CHAT_CHUNK, ChunkTemplate

hostile = st.text(max_size=12) | st.sampled_from(["assistant", "", "\x00\u2028\"\\", "🦙" * 3, "\ud7ff\ue000"])


def written_out(s: SimpleNamespace) -> bytes:
    """The opening as each chunk is written in full."""
    parts = []
    for i in range(s.total):
        parts.append(s.head_idx[i] + b'{"role":' + encode(s.role)
                     + b',"content":""},"logprobs":null,"finish_reason":null}]'
                     + (s.usage_part(0) if s.continuous else b"")
                     + b',"prompt_token_ids":' + (encode(s.prompt_ids) if s.rti else b"null")
                     + b',"prompt_text":null}\n\n')
    if s.echo_text:
        for i in range(s.total):
            parts.append(s.heads[i] + encode(s.echo_text) + b'},"logprobs":null,"finish_reason":null}]'
                         + (s.usage_part(0) if s.continuous else b"") + b"}\n\n")
    return b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(role=hostile, echo=hostile, total=st.integers(1, 4), rti=st.booleans(), continuous=st.booleans(),
       reasoning=st.booleans(), rid=hostile, model=hostile, created=st.integers(-2**63, 2**63),
       prompt_ids=st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=6))
def test_the_opening_is_the_chunks_written_out(role, echo, total, rti, continuous, reasoning, rid, model, created,
                                                prompt_ids):
    tpl = ChunkTemplate(CHAT_CHUNK, rid, created, model, None)
    head_idx = [tpl.choice(i) + b',"delta":' for i in range(total)]
    s = SimpleNamespace(role=role, echo_text=echo, total=total, single=total == 1, rti=rti, continuous=continuous,
                        prompt_ids=prompt_ids, prompt_len=len(prompt_ids), head_idx=head_idx,
                        heads=[h + b'{"content":' for h in head_idx],
                        settings=SimpleNamespace(reasoning_parser="x" if reasoning else None))
    s.usage_part = lambda n, st=None: ChatStream.usage_part(s, n, st)
    assert ChatStream.opening(s) == written_out(s)
    assert ChatStream.opening(s) == written_out(s)  # (the role's delta kept)
