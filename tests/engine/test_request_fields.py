"""The engine's Request reads its request's fields without the EngineCoreRequest properties' calls
(LoRA name, path and id; kv_transfer_params; stop ids) and answers `is_prefilling` without
`prefill_target`'s: each is held to the plain reading on hostile input."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.engine.request import Request
from vllm_vcr.engine.types import EngineCoreRequest, LoRARequest, SamplingParams

_loras = st.one_of(
    st.none(),
    st.builds(LoRARequest, st.text(max_size=5), st.integers(0, 9), st.text(max_size=5)),
    st.lists(st.one_of(st.text(max_size=4), st.integers(-3, 9), st.none()), max_size=4),
)
_extra = st.one_of(st.none(), st.just({}), st.dictionaries(
    st.sampled_from(["kv_transfer_params", "x", "output_replay_id"]),
    st.one_of(st.none(), st.just({}), st.just({"do_remote_decode": True}), st.integers(0, 2)), max_size=3))


@settings(max_examples=200, deadline=None)
@given(lora=_loras, extra=_extra, stop=st.one_of(st.none(), st.lists(st.integers(0, 50), max_size=4)),
       salt=st.one_of(st.none(), st.text(max_size=3)))
def test_request_fields_equal_the_properties(lora, extra, stop, salt):
    sp = SamplingParams(max_tokens=4, extra_args=extra, stop_token_ids=stop)
    ecr = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=sp, lora_request=lora,
                            cache_salt=salt)
    req = Request(ecr, sp, 4, 0.0, 1)
    assert (req.lora_name, req.lora_path, req.lora_id) == (ecr.lora_name, ecr.lora_path, ecr.lora_int_id)
    assert req.kv_transfer_params == ecr.kv_transfer_params
    assert req.stop_ids == frozenset(stop or ()) and type(req.stop_ids) is frozenset
    assert req.cache_salt == salt


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(1, 40), outputs=st.integers(0, 40), computed=st.integers(0, 90))
def test_is_prefilling_is_below_the_prefill_target(prompt, outputs, computed):
    """A fresh request, one with outputs (resumed after preemption), computed counts on both sides."""
    sp = SamplingParams(max_tokens=64)
    req = Request(EngineCoreRequest(request_id="r", prompt_token_ids=list(range(prompt)), sampling_params=sp),
                  sp, 64, 0.0, 1)
    req.output_token_ids += range(outputs)
    req.all_token_ids += range(outputs)
    req.num_computed_tokens = computed
    assert req.is_prefilling == (req.num_computed_tokens < req.prefill_target)
