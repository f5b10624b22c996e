"""The per-request header look-ups done in C (app._has_header, app._first_header) and the kept
Content-Type verdicts (middleware.check_json_content_type) answer as the plain loops and checks
they replace, for hostile header lists and values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_vcr.frontend.errors import HTTPError
from vllm_vcr.http import middleware
from vllm_vcr.serve.app import _first_header, _has_header

names = st.sampled_from([b"content-length", b"Content-Length", b"origin", b"content-type", b"", b"x\x00"]) | st.binary(
    max_size=6)
header_lists = st.lists(st.tuples(names, st.binary(max_size=8)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(headers=header_lists | st.none() | st.just([]), name=names, as_lists=st.booleans())
def test_header_lookups_match_the_loops(headers, name, as_lists):
    if headers is not None and as_lists:
        headers = [list(h) for h in headers]
    plain_first = None
    for k, v in headers or ():
        if k == name:
            plain_first = v
            break
    assert _first_header(headers, name) == plain_first
    assert _has_header({"headers": headers}, name) == any(k == name for k, _ in headers or ())


def plain_check(value: bytes) -> bool:
    content_type = value.decode("latin-1").lower()
    return content_type.split(";", 1)[0].strip() == "application/json"


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.sampled_from([b"application/json", b"Application/JSON; charset=utf-8", b" application/json ",
                                        b"application/jsonx", b"text/plain", b"", b"application/json\xff;x"])
                       | st.binary(max_size=24), max_size=6))
def test_kept_content_type_verdicts_match_the_check(values):
    for value in values + values:  # each seen twice: the second may be the kept verdict
        headers = {b"content-type": value}
        if plain_check(value):
            middleware.check_json_content_type(headers)
        else:
            with pytest.raises(HTTPError):
                middleware.check_json_content_type(headers)
    with pytest.raises(HTTPError):
        middleware.check_json_content_type({})
