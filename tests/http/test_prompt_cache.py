"""The exact-content cache of plain chat prompts: exact (different inputs never share an entry,
a hit equals a fresh render), bounded, and off for anything unusual."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.chat_template import ChatTemplate
from vllm_vcr.frontend.prompt_cache import PromptCache, plain_key, template_is_pure
from vllm_vcr.frontend.protocol import RequestValueError
from vllm_vcr.frontend.tokenizer import load_tokenizer
from vllm_vcr.openai.chat import ChatServing
from vllm_vcr.serve.settings import ServeSettings

TOK = load_tokenizer()
_roles = st.sampled_from(["system", "user", "assistant", "tool", "u", "us"])
_messages = st.lists(st.fixed_dictionaries({"role": _roles, "content": st.text(max_size=40)}),
                     min_size=1, max_size=4)


def serving() -> ChatServing:
    return ChatServing(None, TOK, ServeSettings())


def render(chat: ChatServing, messages, add_generation_prompt=True, add_special_tokens=False, **extra):
    kw = {"continue_final_message": False, "chat_template": None, "chat_template_kwargs": None, **extra}
    return asyncio.run(chat.render_prompt_async(messages, add_generation_prompt=add_generation_prompt,
                                                add_special_tokens=add_special_tokens, **kw))


@settings(max_examples=300, deadline=None)
@given(_messages, st.booleans(), st.booleans(), _messages, st.booleans(), st.booleans())
def test_keys_equal_only_for_equal_inputs(m1, g1, s1, m2, g2, s2):
    k1, k2 = plain_key(m1, g1, s1), plain_key(m2, g2, s2)
    assert k1 is not None and k2 is not None
    assert (k1 == k2) == ((m1, g1, s1) == (m2, g2, s2))


def test_role_and_content_boundaries_are_part_of_the_key():
    a = [{"role": "user", "content": "ab"}]
    b = [{"role": "userab", "content": ""}]
    c = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert len({plain_key(m, True, False) for m in (a, b, c)}) == 3


@pytest.mark.parametrize("messages", [
    [],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "hi", "name": "x"}],
    [{"role": "", "content": "hi"}],
    [{"role": 1, "content": "hi"}],
    [{"role": "user", "content": "x" * 70000}],
    ["user"],
])
def test_unusual_conversations_take_the_slow_path(messages):
    assert plain_key(messages, True, False) is None


def test_bounded_and_hands_out_fresh_lists():
    cache = PromptCache(max_entries=3)
    for i in range(10):
        cache.put((True, False, ("user", str(i))), str(i), [i])
        assert len(cache) <= 3
    text, ids = cache.get((True, False, ("user", "9")))
    ids.append(99)
    assert cache.get((True, False, ("user", "9"))) == ("9", [9])
    assert cache.get((True, False, ("user", "0"))) is None


def test_a_template_that_reads_the_clock_is_never_cached():
    assert template_is_pure("{{ messages[0].content }}")
    assert not template_is_pure("{{ strftime_now('%d') }}")
    assert not template_is_pure(None)


@settings(max_examples=150, deadline=None)
@given(_messages, st.booleans(), st.booleans())
def test_a_hit_equals_a_fresh_render(messages, gen, special):
    chat = serving()
    fresh = chat.render_prompt(messages, add_generation_prompt=gen, continue_final_message=False,
                               chat_template=None, chat_template_kwargs=None, add_special_tokens=special)
    assert render(chat, messages, gen, special) == fresh  # miss, stored
    assert render(chat, messages, gen, special) == fresh  # hit
    cache = chat._prompt_cache()
    assert cache is not None and len(cache) == 1


def test_different_conversations_get_their_own_prompts():
    chat = serving()
    a = render(chat, [{"role": "user", "content": "hello"}])
    b = render(chat, [{"role": "user", "content": "hello!"}])
    c = render(chat, [{"role": "user", "content": "hello"}], add_generation_prompt=False)
    assert len({a[0], b[0], c[0]}) == 3
    assert render(chat, [{"role": "user", "content": "hello"}]) == a


def test_errors_are_not_cached_and_stay_vllms():
    chat = serving()
    for _ in range(2):
        with pytest.raises(RequestValueError, match="empty conversation"):
            render(chat, [])
    assert len(chat._prompt_cache()) == 0


def test_a_new_template_starts_a_new_cache():
    chat = serving()
    render(chat, [{"role": "user", "content": "hi"}])
    old = chat._prompt_cache()
    tok = load_tokenizer()
    tok.chat_template = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    chat.tokenizer = tok
    assert chat._prompt_cache() is not old
    assert render(chat, [{"role": "user", "content": "hi"}])[0] == "[hi]"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=64), st.integers(0, 200)), max_size=60))
def test_the_body_cache_counts_what_its_values_hold(entries):
    """The repeated-body cache counts each body with the bytes its value holds, stays within its
    byte bound (a lone entry over it is the one exception) and never keeps a body over its size limit."""
    from vllm_vcr.frontend.prompt_cache import BodyCache

    cache = BodyCache(max_entries=8, max_body=48, max_bytes=400)
    costs: dict[bytes, int] = {}  # what each kept body was counted at
    for body, held in entries:
        before = len(cache)
        cache.put(body, held, held=held)
        if len(body) > 48:
            assert cache.get(body) is None
            continue
        if len(cache) <= before and body not in costs:  # it was cleared to make room
            costs.clear()
        costs.setdefault(body, len(body) + held)
        assert cache.get(body) == held and len(cache) == len(costs) <= 8
        assert cache.size == sum(costs.values())
        assert cache.size <= 400 or len(cache) == 1
