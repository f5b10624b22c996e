"""A request body decoded by msgspec (`fast_json`) is what json.loads makes of it, and every body
gets the same answer from `parse_request` with the fast decoder as with json.loads alone.

Hostile bodies: JSON of every value type (big and negative integers, floats near and past a
double's range, -0.0, NaN and Infinity spelt as Python's json writes them, strings with control
characters, lone and paired surrogates as escapes and as raw bytes), then cut, spliced and
sprinkled with stray bytes, byte order marks, UTF-16, deep nesting and plain binary.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.errors import HTTPError
from vllm_vcr.frontend.protocol import ChatCompletionRequest, CompletionRequest, RequestValueError
from vllm_vcr.http import serving_base
from vllm_vcr.http.serving_base import fast_json, parse_request


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (1 is not 1.0, -0.0 is not 0.0, NaN is NaN)."""
    stack = [(a, b)]
    while stack:
        a, b = stack.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            if not ((math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))):
                return False
        elif isinstance(a, list):
            if len(a) != len(b):
                return False
            stack.extend(zip(a, b))
        elif isinstance(a, dict):
            if list(a) != list(b):
                return False
            stack.extend((a[k], b[k]) for k in a)
        elif a != b:
            return False
    return True


text = st.text(st.characters(codec=None, categories=None), max_size=12) | st.sampled_from(
    ["\ud800", "\udfff", "\ud83d\ude00", "\x00", "\x1f", "\x7f", "\u2028", "é中😀", '"\\'])
numbers = (st.integers() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0.0, -0.0, 1e308, 1.7976931348623157e308, 5e-324, 2**64, -(2**63) - 1]))
leaves = st.none() | st.booleans() | numbers | text
values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
                      max_leaves=12)
# request-shaped objects, so that some reach the model and its validators
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | text,
                                           "content": text | values}), max_size=3)
requests = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", None]) | text, "messages": messages | values},
    optional={"max_tokens": numbers | values, "temperature": numbers, "stream": st.booleans() | values,
              "stop": text | st.lists(text, max_size=2), "logit_bias": st.dictionaries(text, numbers, max_size=2),
              "n": numbers, "prompt": text | values, "seed": numbers, "extra": values})


@st.composite
def dumped(draw) -> bytes:
    obj = draw(requests | values)
    s = json.dumps(obj, ensure_ascii=draw(st.booleans()), allow_nan=True,
                   indent=draw(st.sampled_from([None, 0, 2])))
    raw = s.encode("utf-8", "surrogatepass")  # a lone surrogate as its (invalid) UTF-8 bytes
    return draw(st.sampled_from([raw, s.encode("utf-16", "surrogatepass"), b"\xef\xbb\xbf" + raw, b" \n" + raw + b"\t"]))


@st.composite
def mutated(draw) -> bytes:
    raw = bytearray(draw(dumped()))
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["cut", "insert", "delete"]))
        if op == "cut":
            del raw[pos:]
        elif op == "insert":
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=3) | st.sampled_from(
                [b"\\", b'"', b"\\u", b"\\ud800", b"NaN", b"-", b"1e999", b",", b"}", b"]", b"\x00", b"\xed\xa0\x80"]))
        elif raw:
            del raw[min(pos, len(raw) - 1)]
    return bytes(raw)


bodies = (dumped() | mutated() | st.binary(max_size=40)
          | st.integers(1, 3000).map(lambda d: b'{"a":' + b"[" * d + b"]" * d + b"}"))


def outcome(body: bytes, model: type) -> Any:
    try:
        req = parse_request(body, model)
    except HTTPError as e:
        return ("error", e.status, e.body(), e.headers)
    except RequestValueError as e:
        return ("value", str(e), e.param)
    return ("ok", req.model_dump(warnings=False), req.model_extra)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(bodies)
@example(b'{"a":1e400}').via("out of a float's range")
@example(b'{"a":"\\ud800"}').via("a lone surrogate escape")
@example(b'{"a":NaN, "b": -Infinity}').via("NaN")
@example(b'\xef\xbb\xbf{"a":1}').via("a byte order mark")
@example(b'{"a":1,"a":2.0}').via("a repeated key")
@example(b'{"a":123456789012345678901234567890,"b":-0,"c":-0.0}').via("big ints, negative zero")
def test_fast_json_is_json_loads(body: bytes) -> None:
    fast = fast_json(body)
    try:
        slow = json.loads(body)
    except Exception:  # json.loads refuses it: so must msgspec
        assert fast is None
        return
    if fast is None and body.strip() != b"null":
        return  # left to json.loads
    assert same(fast, slow)
    json.dumps(fast, ensure_ascii=False).encode("utf-8")  # nothing a lone surrogate would break


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(bodies, st.sampled_from([ChatCompletionRequest, CompletionRequest]))
@example(b'{"model":"m","messages":[{"role":"user","content":"hi \\ud800"}]}', ChatCompletionRequest)
@example(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e400}', ChatCompletionRequest)
@example(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}', ChatCompletionRequest)
@example(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"n":1.0}', ChatCompletionRequest)
@example(b'{"messages":' + b"[" * 950 + b"]" * 950 + b"}", ChatCompletionRequest).via("deep, near the stack's end")
def test_parse_request_same_with_and_without_fast_json(body: bytes, model: type) -> None:
    fast = outcome(body, model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving_base, "fast_json", lambda body: None)
        plain = outcome(body, model)
    assert repr(fast) == repr(plain)
