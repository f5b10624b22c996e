"""Every JSON type as the body of the vLLM routes that read the body themselves (/scale_elastic_ep,
/invocations) or not at all (/release_kv_cache_memory), through a real `vllm-vcr serve`.

Each answer is vLLM 0.32's (its handlers in vllm/entrypoints/serve/, checked against the real
frontend by tests/conformance/test_wrong_type_bodies.py): a JSON error body with vLLM's status,
type and message, never a plain-text traceback, and the server keeps serving. Where vLLM itself
answers 500 (its handler calls `body.get` on whatever JSON it got; a 10,000-deep nesting overflows
the JSON parser's stack; the engine core refuses a release without a completed pause), so does
this server, with vLLM's words.
"""

from __future__ import annotations

import httpx
import pytest

DEV = {"VLLM_SERVER_DEV_MODE": "1"}
FAST = ["--inter-token-latency", "0", "--time-to-first-token", "0"]
DEPTH = 10_000
DEEP_ARRAY = b"[" * DEPTH + b"]" * DEPTH
DEEP_OBJECT = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH
RECURSION = "maximum recursion depth exceeded while decoding a JSON {} from a unicode string"

# name -> (body, the Python type name vLLM's `body.get` fails on)
SCALARS = {
    "null": (b"null", "NoneType"),
    "true": (b"true", "bool"),
    "integer": (b"3", "int"),
    "number": (b"2.5", "float"),
    "string": (b'"x"', "str"),
    "list": (b"[1, 2]", "list"),
    "empty list": (b"[]", "list"),
}
DEEP = {"deep array": (DEEP_ARRAY, "array"), "deep object": (DEEP_OBJECT, "object")}
ALL_BODIES = {**{k: v[0] for k, v in SCALARS.items()}, **{k: v[0] for k, v in DEEP.items()}, "object": b"{}"}
NOT_PAUSED = ("Call to release_kv_cache_memory method failed: "
              "release_kv_cache_memory() requires a completed pause first")


@pytest.fixture(scope="module")
def dev(serve_harness, tmp_path_factory):
    log = tmp_path_factory.mktemp("wrong-types") / "serve.log"
    sp = serve_harness.ServeProcess(FAST, env=DEV, log_path=log).wait_ready()
    yield sp
    assert sp.stop() == 0


def post(sp, path: str, body: bytes) -> httpx.Response:
    return httpx.post(sp.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    err = r.json()["error"]
    assert err["code"] == r.status_code
    return err


def still_serving(sp) -> None:
    assert httpx.get(sp.url + "/health", timeout=10).status_code == 200
    r = httpx.post(sp.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("name", list(SCALARS))
def test_scale_elastic_ep_with_a_body_that_is_no_object(dev, name):
    body, pytype = SCALARS[name]
    err = error_of(post(dev, "/scale_elastic_ep", body))
    assert (err["code"], err["type"], err["message"]) == (
        500, "InternalServerError", f"'{pytype}' object has no attribute 'get'")


@pytest.mark.parametrize("path", ["/scale_elastic_ep", "/invocations"])
@pytest.mark.parametrize("name", list(DEEP))
def test_nesting_deeper_than_the_parser(dev, path, name):
    body, kind = DEEP[name]
    err = error_of(post(dev, path, body))
    assert (err["code"], err["type"], err["message"]) == (500, "InternalServerError", RECURSION.format(kind))
    still_serving(dev)


@pytest.mark.parametrize("name", list(SCALARS))
def test_invocations_with_a_body_that_is_no_request(dev, name):
    err = error_of(post(dev, "/invocations", SCALARS[name][0]))
    assert (err["code"], err["type"]) == (400, "BadRequestError")


def test_the_object_bodies_are_validated(dev):
    err = error_of(post(dev, "/scale_elastic_ep", b"{}"))
    assert (err["code"], err["message"]) == (400, "new_data_parallel_size is required")
    err = error_of(post(dev, "/scale_elastic_ep", b'{"new_data_parallel_size": [1]}'))
    assert (err["code"], err["message"]) == (400, "new_data_parallel_size must be a positive integer")
    err = error_of(post(dev, "/invocations", b'{"messages": 3}'))
    assert err["code"] == 400


@pytest.mark.parametrize("name", list(ALL_BODIES))
def test_release_kv_cache_memory_ignores_its_body(dev, name):
    """The route reads no body: unpaused it is the engine core's refusal (vLLM's 500), after a
    completed pause the release, whatever was sent."""
    body = ALL_BODIES[name]
    err = error_of(post(dev, "/release_kv_cache_memory", body))
    assert (err["code"], err["type"], err["message"]) == (500, "InternalServerError", NOT_PAUSED)
    assert httpx.post(dev.url + "/pause").json() == {"status": "paused"}
    try:
        r = post(dev, "/release_kv_cache_memory", body)
        assert r.status_code == 200 and r.json() == {"status": "kv_cache_released"}
    finally:
        assert httpx.post(dev.url + "/wake_up", params={"tags": "kv_cache"}).json()["status"] == "awake"
    still_serving(dev)
