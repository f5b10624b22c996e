"""Long new prompts are tokenized in a worker thread (vLLM's renderer pool, --renderer-num-workers),
so the event loop keeps reading requests and writing tokens meanwhile; the ids are encode()'s."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.tokenizer import load_tokenizer

LONG = " ".join(f"word{i} and more text" for i in range(40))  # > OFFLOAD_MIN_CHARS
SHORT = "hello there"
_PLAIN = load_tokenizer(None)  # (hypothesis tests cannot take the function-scoped fixture)


@pytest.fixture
def tok():
    t = load_tokenizer(None)
    assert len(LONG) >= t.OFFLOAD_MIN_CHARS > len(SHORT)
    yield t
    t.use_worker_threads(0)  # shuts its pool down


class _HF:
    """The HF tokenizer, with its encodes observed (`on_encode` runs in the calling thread)."""

    def __init__(self, hf, on_encode):
        self._hf, self._on_encode = hf, on_encode
        self.batches: list[list[str]] = []

    def encode(self, *a, **kw):
        self._on_encode()
        return self._hf.encode(*a, **kw)

    def encode_batch_fast(self, texts, **kw):
        self._on_encode()
        self.batches.append(list(texts))
        return self._hf.encode_batch_fast(texts, **kw)

    def __getattr__(self, name):
        return getattr(self._hf, name)


def _record_threads(tok) -> list[str]:
    """Names of the threads that ran the HF encode from now on."""
    seen: list[str] = []
    tok.hf = _HF(tok.hf, lambda: seen.append(threading.current_thread().name))
    return seen


async def test_same_ids_as_encode(tok):
    for text in (LONG, SHORT, LONG + "x" * 70_000):
        for special in (True, False):
            assert await tok.encode_async(text, special) == tok.encode(text, special)


async def test_a_long_new_prompt_goes_to_the_worker_thread_once(tok):
    seen = _record_threads(tok)
    first = await tok.encode_async(LONG)
    again = await tok.encode_async(LONG)  # the cache, on the loop: no hand-over
    short = await tok.encode_async(SHORT)
    assert seen[0].startswith("vllm-vcr-tokenize") and seen[1:] == ["MainThread"]
    assert first == again and short == tok.encode(SHORT)
    first.append(-1)  # callers own their list
    assert await tok.encode_async(LONG) == again


async def test_the_loop_runs_while_a_prompt_is_tokenized(tok):
    """The encode waits (in its thread) for something only the event loop does: were it run on
    the loop, this would deadlock (bounded by the timeout)."""
    loop_ran = threading.Event()
    expected = tok.hf.encode(LONG + "!").ids  # not through the cache

    def wait_for_the_loop():
        assert loop_ran.wait(5), "the event loop was blocked while the prompt was tokenized"

    tok.hf = _HF(tok.hf, wait_for_the_loop)
    encoding = asyncio.ensure_future(tok.encode_async(LONG + "!"))
    await asyncio.sleep(0)
    loop_ran.set()
    assert await asyncio.wait_for(encoding, 10) == expected


async def test_a_burst_of_new_prompts_is_encoded_in_batches(tok):
    """Prompts that arrive together go to the worker as batches (at most ENCODE_BATCH_MAX each),
    each with encode()'s ids, whatever its add_special_tokens."""
    texts = [f"{LONG} {i}" for i in range(2 * tok.ENCODE_BATCH_MAX + 5)]
    expected = [tok.hf.encode(t, add_special_tokens=i % 3 != 0).ids for i, t in enumerate(texts)]
    seen = _record_threads(tok)
    got = await asyncio.gather(*(tok.encode_async(t, i % 3 != 0) for i, t in enumerate(texts)))
    assert got == expected
    batches = tok.hf.batches
    assert 3 <= len(batches) < len(texts) and max(map(len, batches)) <= tok.ENCODE_BATCH_MAX
    assert sorted(t for b in batches for t in b) == sorted(texts)
    assert all(name.startswith("vllm-vcr-tokenize") for name in seen)


async def test_a_text_the_library_rejects_fails_only_its_own_request(tok):
    bad = LONG + "\ud800"  # a lone surrogate: the tokenizers library raises TypeError
    results = await asyncio.gather(tok.encode_async(LONG + " a"), tok.encode_async(bad), tok.encode_async(LONG + " b"),
                                   return_exceptions=True)
    assert results[0] == tok.encode(LONG + " a") and results[2] == tok.encode(LONG + " b")
    assert isinstance(results[1], TypeError)


async def test_a_request_that_leaves_while_queued_does_not_break_the_others(tok):
    first = asyncio.ensure_future(tok.encode_async(LONG + " c"))
    gone = asyncio.ensure_future(tok.encode_async(LONG + " d"))
    await asyncio.sleep(0)
    gone.cancel()
    assert await first == tok.encode(LONG + " c")
    assert await tok.encode_async(LONG + " e") == tok.encode(LONG + " e")


async def test_no_workers_encodes_in_line(tok):
    tok.use_worker_threads(0)
    seen = _record_threads(tok)
    assert await tok.encode_async(LONG) == tok.encode(LONG)
    assert seen == ["MainThread"]


def test_serve_flag(serve_process):
    sp = serve_process("--renderer-num-workers", "2")
    with openai.OpenAI(base_url=f"{sp.url}/v1", api_key="x", max_retries=0, timeout=30) as c:
        for _ in range(2):  # new, then cached
            r = c.chat.completions.create(model="vllm-vcr/sim", messages=[{"role": "user", "content": LONG}],
                                          max_tokens=3)
            assert r.choices[0].finish_reason == "length"
            assert r.usage.prompt_tokens > 40


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_serve_flag_rejects(serve_process, value):
    sp = serve_process("--renderer-num-workers", value, wait=False)
    assert sp.proc.wait(30) == 2
    sp.stop()
    assert "--renderer-num-workers" in sp.log()


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(min_size=0, max_size=400), min_size=1, max_size=6), special=st.booleans())
def test_the_batch_encode_gives_encodes_ids(texts, special):
    tok = _PLAIN
    assert tok._encode_batch([(t, special) for t in texts]) == [tok.hf.encode(t, add_special_tokens=special).ids
                                                                 for t in texts]

