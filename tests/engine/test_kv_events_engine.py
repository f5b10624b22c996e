"""The engine's KV cache events: what a real vLLM engine would publish for the same requests."""

from vllm_vcr.engine.block_hash import make_block_hasher, request_block_hashes
from vllm_vcr.engine.types import EngineCoreRequest, SamplingParams
from vllm_vcr.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventCollector
from vllm_vcr.kv_events.events import external_block_hash


def attach(h):
    published = []
    h.core.attach_kv_events(KVEventCollector(use_int_hashes=True), lambda evs, ts: published.append((ts, evs)))
    return published


def events(published, kind):
    return [e for _, batch in published for e in batch if isinstance(e, kind)]


def test_block_stored_hashes_are_vllms(harness):
    h = harness(tokens_per_block=16, max_num_batched_tokens=32)
    published = attach(h)
    prompt = h.prompt_of("p", 70)
    h.add("r", prompt=prompt, max_tokens=1)
    h.run()
    stored = events(published, BlockStored)
    expected = [external_block_hash(x, True) for x in request_block_hashes(prompt, 16, make_block_hasher())]
    assert [x for e in stored for x in e.block_hashes] == expected  # 4 full prompt blocks, over 3 chunks
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert [t for e in stored for t in e.token_ids] == prompt[:64]


def test_eviction_and_reset_publish_removed_and_cleared(harness):
    h = harness(tokens_per_block=4, kv_cache_size=4)
    published = attach(h)
    h.add("a", prompt_len=12, max_tokens=1)
    h.run()
    h.add("b", prompt_len=12, max_tokens=1)
    h.run()
    removed = events(published, BlockRemoved)
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    assert h.core.reset_prefix_cache()
    h.core.step(h.clock.now())
    assert events(published, AllBlocksCleared)


def test_cache_salt_and_lora_change_the_hashes_as_vllm(harness):
    h = harness(tokens_per_block=16)
    published = attach(h)
    prompt = h.prompt_of("p", 33)
    h.add_req(EngineCoreRequest(request_id="s", prompt_token_ids=prompt, cache_salt="salt",
                                lora_request=["adapter", 1, "/loras/a"], sampling_params=SamplingParams(max_tokens=1)))
    h.run()
    expected = request_block_hashes(prompt, 16, make_block_hasher(), lora_name="adapter", cache_salt="salt",
                                    lora_path="/loras/a")
    stored = events(published, BlockStored)
    assert [x for e in stored for x in e.block_hashes] == [external_block_hash(x, True) for x in expected]
    assert stored[0].lora_name == "adapter"
