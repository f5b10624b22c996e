"""vLLM's request validation through a real `vllm-vcr serve` and the real clients: the schema errors
vLLM's protocol models raise (tools, response formats, messages and their tool calls, vllm_xargs,
the Anthropic thinking budget, structured-outputs kinds), truncate_prompt_tokens, FastAPI's answers
to bodies that are not JSON objects, the Responses echo of tools and text, the batch chat and
generative-scoring routes, the dev-mode RL routes and the CORS Vary header."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from vllm_vcr.frontend.protocol import ChatCompletionMessageParam, ChatCompletionRequest, RequestValueError, plain_messages
from vllm_vcr.frontend.request_checks import check_structured_outputs_params, truncate_prompt
from vllm_vcr.testing.waits import wait_until

MODEL = "vllm-vcr/sim"
HI = [{"role": "user", "content": "hi"}]
MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
LEN = 2048


@pytest.fixture(scope="module")
def server(serve_harness, tmp_path_factory):
    sp = serve_harness.start_fast(tmp_path_factory, "validation", "--max-model-len", str(LEN), "--mode", "echo",
                                  "--allowed-origins", '["http://ok.example"]', "--enable-server-load-tracking",
                                  "--inter-token-latency", "10",
                                  env={"VLLM_SERVER_DEV_MODE": "1"})
    yield sp
    sp.stop()


def oa(sp) -> openai.OpenAI:
    return openai.OpenAI(base_url=sp.url + "/v1", api_key="x", max_retries=0)


def _bad(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400
    return e.value.response.json()["error"]


# ---- the schema vLLM's request models apply ----------------------------------------------------------

def test_a_tool_of_another_type_is_a_400_not_a_500(server):
    err = _bad(lambda: oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                          tools=[{"type": "retrieval"}]))
    assert err["type"] == "Bad Request" and err["param"] == "body.tools.0.type"
    assert err["message"].startswith("2 validation errors:\n  {'type': 'literal_error', 'loc': 'body.tools.0.type'")


def test_a_function_without_a_name(server):
    err = _bad(lambda: oa(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, tools=[{"type": "function", "function": {"description": "x"}}]))
    assert err["param"] == "body.tools.0.function.name" and "'type': 'missing'" in err["message"]


def test_tool_call_arguments_sent_as_an_object(server):
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "x"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    err = _bad(lambda: oa(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=2))
    assert err["param"] == "body.0.ChatCompletionMessageFunctionToolCallParam.function"
    assert err["message"].startswith("3 validation errors:")


def test_response_format_of_an_unknown_type(server):
    err = _bad(lambda: oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                          response_format={"type": "yaml"}))
    assert err["param"] == "body.response_format.type" and err["message"].startswith("6 validation errors:")


@pytest.mark.parametrize("so", [{}, {"foo": 1}])
def test_structured_outputs_without_a_known_kind(server, so):
    err = _bad(lambda: oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                          extra_body={"structured_outputs": so}))
    assert err["type"] == "BadRequestError" and err["param"] is None
    assert err["message"].startswith("You must use one kind of structured outputs constraint but none are "
                                     "specified: {'json': None, 'regex': None,")


def test_structured_outputs_params_show_the_dataclass_fields():
    with pytest.raises(RequestValueError, match=r"multiple are specified: \{'json': None, 'regex': 'a', "
                                                r"'choice': None, 'grammar': 'root ::= \"a\"'"):
        check_structured_outputs_params({"regex": "a", "grammar": 'root ::= "a"', "unknown": 1})
    check_structured_outputs_params({"choice": ["a"], "disable_any_whitespace": True})


@pytest.mark.parametrize("xargs,count", [({"a": {"b": 1}}, 4), ({"a": [[1]]}, 6)])
def test_nested_vllm_xargs(server, xargs, count):
    err = _bad(lambda: oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                          extra_body={"vllm_xargs": xargs}))
    assert err["param"] == "body.vllm_xargs.a" and err["message"].startswith(f"{count} validation errors:")
    oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                       extra_body={"vllm_xargs": {"a": [1, "x", 2.5], "b": "s"}})


def test_messages_in_vllm_s_union(server):
    err = _bad(lambda: oa(server).chat.completions.create(model=MODEL, messages=[{"content": "hi"}], max_tokens=2))
    assert err["param"] == "body.messages.0.ChatCompletionDeveloperMessageParam.role"
    assert err["message"].startswith("11 validation errors:") and "Message.author" in err["message"]
    oa(server).chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2)  # a custom role's


# ---- truncate_prompt_tokens --------------------------------------------------------------------------

def test_truncation_keeps_the_last_tokens(server):
    c = oa(server).completions.create(model=MODEL, prompt=list(range(100, 112)), max_tokens=3,
                                      extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert c.usage.prompt_tokens == 3
    assert c.choices[0].prompt_token_ids == [109, 110, 111]
    c = oa(server).completions.create(model=MODEL, prompt=list(range(100, 112)), max_tokens=3, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True})
    assert c.choices[0].prompt_token_ids == [100, 101, 102]
    chat = oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                              extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_minus_one_means_the_context_less_one_token(server):
    c = oa(server).completions.create(model=MODEL, prompt=[100] * (LEN + 40), max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert c.usage.prompt_tokens == LEN - 1 and c.usage.completion_tokens == 1


def test_truncation_above_the_context_and_to_nothing(server):
    for create in (lambda **kw: oa(server).completions.create(model=MODEL, prompt="a b c", max_tokens=2, **kw),
                   lambda **kw: oa(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **kw)):
        err = _bad(lambda: create(extra_body={"truncate_prompt_tokens": LEN + 1}))
        assert err["param"] == "truncate_prompt_tokens"
        assert err["message"] == (f"truncate_prompt_tokens={LEN + 1} cannot be greater than max_model_len = {LEN}. "
                                  f"Please request a smaller truncation size. (parameter=truncate_prompt_tokens, "
                                  f"value={LEN + 1})")
    err = _bad(lambda: oa(server).completions.create(model=MODEL, prompt="a b c", max_tokens=2,
                                                     extra_body={"truncate_prompt_tokens": 0}))
    assert err["message"] == "The decoder prompt cannot be empty"


def test_truncate_prompt_keeps_the_tokenizer_s_special_tokens():
    assert truncate_prompt([1, 5, 6, 7, 8], 3, None, 100, specials=(1, 0)) == [1, 7, 8]
    assert truncate_prompt([1, 5, 6, 7, 2], 3, "right", 100, specials=(1, 1)) == [1, 5, 2]
    assert truncate_prompt(list(range(10)), -1, None, 6) == list(range(5, 10))
    assert truncate_prompt(list(range(10)), -1, None, 6, pooling=True) == list(range(4, 10))
    assert truncate_prompt([1, 2], 5, None, 100) == [1, 2]
    with pytest.raises(RequestValueError, match="decoder prompt cannot be empty"):
        truncate_prompt([1, 2], 0, None, 100)


# ---- Anthropic ----------------------------------------------------------------------------------------

def test_thinking_budget(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=1500, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 2000})
    assert "thinking.budget_tokens must be less than max_tokens" in e.value.response.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=10, messages=HI, thinking={"type": "enabled", "budget_tokens": 10})
    assert e.value.response.json()["error"]["param"] == "body.thinking.enabled.budget_tokens"
    m = client.messages.create(model=MODEL, max_tokens=2000, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=["i"])
    assert m.type == "message"


# ---- bodies that are not JSON objects (raw HTTP) ----------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
def test_text_plain_is_refused(server, path):
    r = httpx.post(server.url + path, content=json.dumps({"model": MODEL, "input": "hi", "messages": HI,
                                                           "max_tokens": 2}), headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"


@pytest.mark.parametrize("body,kind,shown", [(b"null", "missing", "None"), (b'"hello"', "model_attributes_type", "hello"),
                                              (b"[1, 2]", "model_attributes_type", "<list of 2 items>")])
def test_a_body_that_is_not_an_object(server, body, kind, shown):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "body" and err["type"] == "Bad Request"
        assert f"'type': '{kind}', 'loc': 'body'" in err["message"] and f"'input': '{shown}'" in err["message"]


TEXT_ENCODE_INPUT = "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "\\udc00", "max_tokens": 2, "stream": true}'),
    ("/v1/responses", b'{"input": "\\ud800", "max_output_tokens": 2}'),
    ("/tokenize", b'{"prompt": "x\\udfff"}'),
])
def test_a_lone_surrogate_gets_the_tokenizer_s_400_as_vllm_answers_it(server, path, body):
    """vLLM (0.32, 0.33) parses a lone surrogate escape and its tokenizer refuses the text: a 400
    BadRequestError with the tokenizer's message (tests/conformance compares the two)."""
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": TEXT_ENCODE_INPUT, "type": "BadRequestError", "param": None,
                                  "code": 400}}


def test_a_lone_surrogate_in_a_messages_request_is_refused_in_anthropic_s_error_body(server):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode()
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, path
        assert r.json() == {"type": "error", "error": {"type": "BadRequestError", "message": TEXT_ENCODE_INPUT}}


@pytest.mark.parametrize("body", [b'{"messages": [{"role": "user", "content": "\xff"}]}', b'{"a": ' + b"[" * 5000])
def test_unparsable_bodies_get_fastapi_s_own_answer(server, body):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"detail": "There was an error parsing the body"}


@pytest.mark.parametrize("messages,message", [(None, "'NoneType' object is not iterable"),
                                              (5, "'int' object is not iterable")])
def test_messages_that_cannot_be_iterated(server, messages, message):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400 and r.json()["error"] == {"message": message, "type": "BadRequestError",
                                                          "param": None, "code": 400}


def test_empty_prompts(server):
    err = _bad(lambda: oa(server).completions.create(model=MODEL, prompt=[], max_tokens=2))
    assert err["message"] == "You must pass at least one prompt"
    err = _bad(lambda: oa(server).completions.create(model=MODEL, prompt=[[]], max_tokens=2))
    assert err["message"] == "The decoder prompt cannot be empty"


# ---- Responses -----------------------------------------------------------------------------------------

def test_responses_echo_tools_and_text_with_their_null_fields(server):
    raw = oa(server).responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2, tool_choice="none",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    body = raw.http_response.json()
    assert body["tools"] == [{"name": "f", "parameters": {"type": "object"}, "strict": None, "type": "function",
                              "allowed_callers": None, "async": None, "defer_loading": None, "description": None,
                              "output_schema": None}]
    assert body["text"] == {"format": {"name": "x", "schema": {"type": "object"}, "type": "json_schema",
                                       "description": None, "strict": None}, "verbosity": None}
    body = oa(server).responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2,
                                                         text={"verbosity": "low"}).http_response.json()
    assert body["text"] == {"format": None, "verbosity": "low"}


def test_responses_budget_names_max_output_tokens(server):
    err = _bad(lambda: oa(server).responses.create(model=MODEL, input="hi", max_output_tokens=LEN + 1))
    assert err["param"] == "max_output_tokens"
    assert err["message"].startswith(f"max_output_tokens={LEN + 1} cannot be greater than max_model_len={LEN}.")


# ---- routes -------------------------------------------------------------------------------------------------

def test_batch_chat_completions(server):
    r = oa(server).post("/chat/completions/batch", cast_to=httpx.Response, body={
        "model": MODEL, "max_tokens": 3, "messages": [HI, [{"role": "user", "content": "say more words"}]]})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 6
    single = [oa(server).chat.completions.create(model=MODEL, max_tokens=3, messages=m).usage.prompt_tokens
              for m in (HI, [{"role": "user", "content": "say more words"}])]
    assert body["usage"]["prompt_tokens"] == sum(single)
    err = _bad(lambda: oa(server).post("/chat/completions/batch", cast_to=httpx.Response,
                                       body={"model": MODEL, "messages": [HI], "n": 2}))
    assert err["message"] == ("Batch chat completions do not support `n > 1`. Please set `n` to 1. "
                              "(parameter=n, value=2)")


def test_generative_scoring(server):
    def score(**kw):
        r = httpx.post(server.url + "/generative_scoring", json={"model": MODEL, "query": "Is it good?", **kw})
        return r.status_code, r.json()

    status, body = score(items=["yes", "no", "maybe"], label_token_ids=[50, 60])
    assert status == 200 and body["object"] == "list" and body["id"].startswith("generative-scoring-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and all(0 < d["score"] < 1 for d in body["data"])
    assert body["usage"]["completion_tokens"] == 3
    assert score(items=["yes"], label_token_ids=[50])[1]["data"][0]["score"] == 1.0  # softmax over one label
    assert 0 < score(items=["yes"], label_token_ids=[50], apply_softmax=False)[1]["data"][0]["score"] < 1
    assert score(items=[], label_token_ids=[5]) == (400, {"error": {
        "message": "items must contain at least one item.", "type": "BadRequestError", "param": None, "code": 400}})


def test_dev_mode_routes(server):
    base = server.url
    assert httpx.get(base + "/weight_info").json() == {"weight_version": "default"}
    assert httpx.post(base + "/update_weight_version", json={"new_version": "v7"}).json() == \
        {"success": True, "new_version": "v7"}
    assert httpx.get(base + "/weight_info").json() == {"weight_version": "v7"}
    assert httpx.get(base + "/get_world_size").json() == {"world_size": 1}
    assert httpx.get(base + "/kv_event_sources").json() == {}
    assert httpx.post(base + "/weight_checker", json={"action": "compare", "baseline": {"w": "1"}}).json() == \
        {"match": False, "mismatches": ["w"]}
    r = httpx.post(base + "/collective_rpc", json={"method": "echo"})
    assert r.status_code == 500 and "does not simulate 'collective_rpc'" in r.json()["error"]["message"]
    r = httpx.post(base + "/update_weights", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.update_info"
    for page in ("/docs", "/redoc"):
        r = httpx.get(base + page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and "/openapi.json" in r.text
    paths = httpx.get(base + "/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions/batch", "/generative_scoring", "/abort_requests", "/collective_rpc",
                 "/get_world_size", "/weight_info", "/update_weights", "/kv_event_sources"):
        assert path in paths


def test_abort_requests_ends_a_stream_in_flight(server):
    got: dict = {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, headers={"x-request-id": "long-1"},
                          json={"model": MODEL, "prompt": "a", "max_tokens": 200, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            got["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: httpx.get(server.url + "/load").json()["server_load"] > 0, 30, "the stream in flight")
    r = httpx.post(server.url + "/abort_requests", json={"request_ids": ["cmpl-long-1"]})
    assert r.json() == {"status": "aborted", "aborted": 1}
    t.join(60)
    assert not t.is_alive() and got["events"][-1] == "data: [DONE]"
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in got["events"][:-1]
                if json.loads(e[6:])["choices"]]
    assert finishes[-1] == "abort" and len(finishes) < 200
    assert httpx.post(server.url + "/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}


def test_one_vary_origin_with_cors(server):
    r = httpx.get(server.url + "/v1/models", headers={"origin": "http://ok.example"})
    assert r.headers.get_list("vary") == ["Origin"]
    r = httpx.post(server.url + "/v1/completions", headers={"origin": "http://ok.example"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.headers.get_list("vary") == ["Origin"]


# ---- the fast path for plain messages ----------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=6)
_message = st.one_of(
    _json,
    st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "author"]), _json,
                    max_size=4),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", ""])},
                          optional={"content": st.text(max_size=5) | _json, "name": st.text(max_size=5) | _json}),
)


@given(st.lists(_message, max_size=4) | _json)
@hyp_settings(max_examples=400, deadline=None)
def test_the_plain_messages_fast_path_only_skips_what_the_union_accepts(messages):
    """Whatever plain_messages lets through, vLLM's message union validates too."""
    if plain_messages(messages):
        MESSAGES.validate_python(messages)


def test_plain_and_full_validation_answer_alike():
    plain = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi", "name": "ann"}]
    assert ChatCompletionRequest.model_validate({"messages": plain}).messages == plain
    assert plain_messages(plain) and not plain_messages([{"role": "user", "content": ["a"]}])


def test_kv_event_sources_report_each_rank_s_publisher(serve_harness, tmp_path_factory):
    port = serve_harness.free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    sp = serve_harness.start_fast(tmp_path_factory, "kv-sources", "--engine-count", "2",
                                  "--kv-events-config", json.dumps(config))
    try:
        sources = httpx.get(sp.url + "/kv_event_sources").json()
    finally:
        sp.stop()
    assert sorted(sources) == ["0", "1"]
    assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{port}"
    assert sources["1"]["endpoint"] == f"tcp://127.0.0.1:{port + 1}"  # vLLM's per-rank port offset
    assert sources["0"]["publisher"] == "zmq" and sources["0"]["enable_kv_cache_events"] is True
