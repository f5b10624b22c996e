"""Long new prompts are tokenized in a worker thread (vLLM's renderer pool, --renderer-num-workers),
so the event loop keeps reading requests and writing tokens meanwhile; the ids are encode()'s."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from vllm_vcr.http.tokenizer import load_tokenizer

LONG = " ".join(f"word{i} and more text" for i in range(40))  # > OFFLOAD_MIN_CHARS
SHORT = "hello there"


@pytest.fixture
def tok():
    t = load_tokenizer(None)
    assert len(LONG) >= t.OFFLOAD_MIN_CHARS > len(SHORT)
    yield t
    t.use_worker_threads(0)  # shuts its pool down


class _HF:
    """The HF tokenizer, with its encode observed (`on_encode` runs in the calling thread)."""

    def __init__(self, hf, on_encode):
        self._hf, self._on_encode = hf, on_encode

    def encode(self, *a, **kw):
        self._on_encode()
        return self._hf.encode(*a, **kw)

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
