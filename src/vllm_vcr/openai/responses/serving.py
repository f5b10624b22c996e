"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel.

As in vLLM 0.32, the store is off unless VLLM_ENABLE_RESPONSES_API_STORE=1: `store: true` is
then silently ignored, GET and `previous_response_id` find nothing (404), and background mode is
a 400. With the store on, responses (and the messages that led to them) are kept in memory;
`background: true` answers "queued" at once and the generation runs on, cancellable; with
`stream: true` as well, the POST streams the events as they come and GET ?stream=true replays
them (background.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any
from urllib.parse import parse_qs

from ...frontend.errors import HTTPError
from ...frontend.protocol import RequestValueError
from ...frontend.request_checks import check_output_budget, sampling_values
from ...http.serving_base import REQUEST_METRICS_FIELDS, RequestContext, encode, parse_request
from ...http.sse import SSEWriter, send_bytes
from ..chat import CACHE_DETAILS_KEY
from ..chat_bridge import run_chat
from .background import EventLog, send_events
from .events import EventStream, output_items
from .protocol import ResponsesRequest, chat_tools, echoed_text, echoed_tools, input_messages, response_format

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


def _invalid(message: str, param: str, status: int = 400) -> HTTPError:
    return HTTPError(status, message, "invalid_request_error", param)


def check_tool_choice(req: ResponsesRequest) -> None:
    """ResponsesRequest.check_tool_usage (a request-model validator)."""
    choice = req.tool_choice
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not req.tools:
        if choice in ("auto", "none"):
            req.tool_choice = "none"
        elif choice == "required":
            raise RequestValueError("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        elif named:
            raise RequestValueError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    elif named and not any(t.get("name") == choice.get("name") for t in req.tools):
        raise RequestValueError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


class ResponsesServing:
    def __init__(self, chat: Any) -> None:
        self.chat = chat
        self.settings = chat.settings
        self.store_enabled = os.environ.get(STORE_ENV, "0").strip().lower() in ("1", "true")
        self.responses: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, list[dict[str, Any]]] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.event_logs: dict[str, EventLog] = {}  # background streams' events, for GET ?stream=true

    # -- POST /v1/responses -------------------------------------------------------------------

    async def create(self, ctx: RequestContext) -> None:
        req: ResponsesRequest = parse_request(ctx.body, ResponsesRequest)
        self.settings.sampling_defaults.fill(req)  # (the response echoes the values the request ran with)
        check_tool_choice(req)
        model = self.chat.check_model(req.model)
        check_output_budget(req.max_output_tokens, self.settings.max_model_len, "max_output_tokens")
        if req.store and not self.store_enabled and req.background:
            raise _invalid("This vLLM engine does not support `store=True` and therefore does not support the "
                           "background mode. To enable these features, set the environment variable "
                           f"`{STORE_ENV}=1` when launching the vLLM server.", "background")
        if req.previous_input_messages and req.previous_response_id:
            raise _invalid("Only one of `previous_input_messages` and `previous_response_id` can be set.",
                           "previous_response_id")
        store = bool(req.store) and self.store_enabled
        prev = None
        if req.previous_response_id is not None:
            prev = self.responses.get(req.previous_response_id)
            if prev is None:
                raise self.not_found(req.previous_response_id)
        messages = input_messages(req, self.messages.get(prev["id"]) if prev else req.previous_input_messages,
                                  prev["output"] if prev else None)
        body = self.chat_body(req, messages, model)
        if store:
            self.messages[req.request_id] = messages
        if req.background and req.stream:
            await self._background_stream(ctx, req, body, model)
        elif req.background:
            await self._background(ctx, req, body, model)
        elif req.stream:
            await self._stream(ctx, req, body, model, store)
        else:
            response = await self._generate(ctx, req, body, model)
            if store and self.responses.get(response["id"], {}).get("status") != "cancelled":
                self.responses[response["id"]] = response
            ctx.finishing = True
            await send_bytes(ctx.send, 200, encode(response))

    def chat_body(self, req: ResponsesRequest, messages: list[dict[str, Any]], model: str) -> dict[str, Any]:
        body = {k: v for k, v in req.model_dump(exclude_none=True).items()
                if k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "priority",
                         "cache_salt", "vllm_xargs", "kv_transfer_params", "chat_template_kwargs",
                         "parallel_tool_calls", "structured_outputs", "logit_bias")}
        # the Responses renderer tokenizes with the tokenizer's special tokens (chat does not)
        body.update(model=model, messages=messages, stream=bool(req.stream), request_id=req.request_id,
                    add_special_tokens=True, **{CACHE_DETAILS_KEY: True})
        if req.max_output_tokens is not None:
            body["max_tokens"] = req.max_output_tokens
        rf = response_format(req)
        if rf is not None:
            body["response_format"] = rf
        tools = chat_tools(req)
        if tools and self.settings.tools.available:  # without a tool parser vLLM reads no calls
            body["tools"] = tools
            body["tool_choice"] = (
                {"type": "function", "function": {"name": req.tool_choice["name"]}}
                if isinstance(req.tool_choice, dict) else req.tool_choice)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _generate(self, ctx: RequestContext, req: ResponsesRequest, body: dict[str, Any],
                        model: str) -> dict[str, Any]:
        created = int(time.time())
        answer = await run_chat(self.chat, ctx, {**body, "stream": False})
        choice = answer["choices"][0]
        output = output_items(choice["message"], req.parallel_tool_calls)
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.response_body(req, model, created, output, status, answer["usage"], answer["metrics"])

    # -- the response object -------------------------------------------------------------------

    def response_body(self, req: ResponsesRequest, model: str, created: int, output: list[dict[str, Any]],
                      status: str, usage: dict[str, Any] | None,
                      metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object (`metrics`: the per-request metrics of --enable-per-request-metrics,
        a field only when there are some, as vLLM serialises it)."""
        max_tokens = req.max_output_tokens
        if usage is not None:
            max_tokens = self.settings.sampling_defaults.limit(usage["prompt_tokens"], self.settings.max_model_len,
                                                               max_tokens)
        sampling = sampling_values(req)
        body = {
            "id": req.request_id, "created_at": created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata, "model": model, "object": "response",
            "output": output, "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None
            else True, "temperature": sampling["temperature"],
            "tool_choice": req.tool_choice, "tools": echoed_tools(req.tools),
            "top_p": sampling["top_p"], "background": req.background,
            "max_output_tokens": max_tokens, "max_tool_calls": req.max_tool_calls,
            "previous_response_id": req.previous_response_id, "prompt": req.prompt, "reasoning": req.reasoning,
            "service_tier": req.service_tier, "status": status, "text": echoed_text(req.text),
            "top_logprobs": req.top_logprobs if "message.output_text.logprobs" in (req.include or ()) else None,
            "truncation": req.truncation, "usage": response_usage(usage), "user": req.user,
            "presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
            "output_messages": None,
        }
        if metrics is not None:
            body["metrics"] = metrics
        return body

    # -- streaming -----------------------------------------------------------------------------

    async def _stream(self, ctx: RequestContext, req: ResponsesRequest, body: dict[str, Any], model: str,
                      store: bool, sink: EventLog | None = None) -> None:
        created = int(time.time())
        w = sink or SSEWriter(ctx.send)
        events = EventStream()
        usage: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        finish: list[str] = []
        opening = self.response_body(req, model, created, [], "in_progress", None)
        started = False

        async def on_chunk(chunk: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                started = True
                await w.write(events.event("response.created", response=opening)
                              + events.event("response.in_progress", response=opening))
            if "error" in chunk:
                raise _StreamFailed(chunk["error"])
            for choice in chunk.get("choices") or ():
                data = events.feed(choice.get("delta") or {})
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
                if data:
                    await w.write(data)
            if chunk.get("usage"):
                usage.update(chunk["usage"])
            if chunk.get("metrics"):  # (the usage chunk's, its null fields left out)
                metrics.update(dict.fromkeys(REQUEST_METRICS_FIELDS) | chunk["metrics"])

        try:
            await run_chat(self.chat, ctx, body, on_chunk)
        except _StreamFailed as e:
            ctx.finishing = True
            await w.close(events.event("error", code=str(e.args[0].get("code")),
                                       message=e.args[0].get("message"), param=None))
            return
        head = b"" if started else (events.event("response.created", response=opening)
                                    + events.event("response.in_progress", response=opening))
        tail = head + b"".join(events.close())
        status = "incomplete" if finish and finish[0] == "length" else "completed"
        final = self.response_body(req, model, created, events.items, status, usage or None, metrics or None)
        if store and self.responses.get(final["id"], {}).get("status") != "cancelled":
            self.responses[final["id"]] = final
        ctx.finishing = True
        await w.close(tail + events.event("response.completed", response=final))

    # -- background, GET and cancel ------------------------------------------------------------

    def _queue(self, ctx: RequestContext, req: ResponsesRequest, model: str) -> tuple[dict[str, Any], RequestContext]:
        """The stored "queued" response, and a context the detached generation runs in."""
        queued = self.response_body(req, model, int(time.time()), [], "queued", None)
        self.responses[queued["id"]] = queued
        return queued, RequestContext({**ctx.scope}, _never_disconnects, _discard, b"")

    def _keep_task(self, rid: str, task: asyncio.Task) -> None:
        self.tasks[rid] = task
        task.add_done_callback(lambda t: (self.tasks.pop(rid, None), t.cancelled() or t.exception()))

    async def _background_stream(self, ctx: RequestContext, req: ResponsesRequest, body: dict[str, Any],
                                 model: str) -> None:
        queued, detached = self._queue(ctx, req, model)
        log = self.event_logs[queued["id"]] = EventLog()

        async def run() -> None:
            try:
                await self._stream(detached, req, body, model, True, log)
            except BaseException:
                if queued["status"] not in ("completed", "cancelled"):
                    queued["status"] = "failed"
                raise
            finally:
                await log.close()  # readers of a cancelled or failed stream stop here

        self._keep_task(queued["id"], asyncio.ensure_future(run()))
        await send_events(ctx, log, 0)

    async def _background(self, ctx: RequestContext, req: ResponsesRequest, body: dict[str, Any],
                          model: str) -> None:
        queued, detached = self._queue(ctx, req, model)

        async def run() -> None:
            try:
                done = await self._generate(detached, req, {**body, "stream": False}, model)
            except Exception:
                if queued["status"] not in ("completed", "cancelled"):
                    queued["status"] = "failed"
                raise
            if self.responses.get(done["id"], {}).get("status") != "cancelled":
                self.responses[done["id"]] = done

        self._keep_task(queued["id"], asyncio.ensure_future(run()))
        ctx.finishing = True
        await send_bytes(ctx.send, 200, encode(queued))

    async def retrieve(self, ctx: RequestContext) -> None:
        rid = ctx.scope["path"].rsplit("/", 1)[-1]
        response = self.responses.get(rid)
        if response is None:
            raise self.not_found(rid)
        stream, starting_after = retrieve_query(ctx)
        if not stream:
            await send_bytes(ctx.send, 200, encode(response))
            return
        log = self.event_logs.get(rid)
        if log is None:  # vLLM fails this inside its stream (after the 200); here it is a plain 400
            raise _invalid(f"Unknown response_id: {rid}", "response_id")
        await send_events(ctx, log, 0 if starting_after is None else starting_after + 1)

    async def cancel(self, ctx: RequestContext) -> None:
        rid = ctx.scope["path"].split("/")[-2]
        response = self.responses.get(rid)
        if response is None:
            raise self.not_found(rid)
        if response["status"] not in ("queued", "in_progress"):
            raise _invalid("Cannot cancel a synchronous response.", "response_id")
        response["status"] = "cancelled"
        task = self.tasks.get(rid)
        if task is not None:
            task.cancel()  # closing the engine stream aborts the request in the engine
            await asyncio.gather(task, return_exceptions=True)
        await send_bytes(ctx.send, 200, encode(response))

    @staticmethod
    def not_found(response_id: str) -> HTTPError:
        return _invalid(f"Response with id '{response_id}' not found.", "response_id", 404)


class _StreamFailed(Exception):
    pass


def retrieve_query(ctx: RequestContext) -> tuple[bool, int | None]:
    """GET /v1/responses/{id}'s `stream` and `starting_after` query parameters."""
    query = parse_qs(ctx.scope.get("query_string", b"").decode("latin-1"))
    stream = (query.get("stream") or ["false"])[-1].strip().lower() in ("1", "true", "yes", "on")
    after = (query.get("starting_after") or [None])[-1]
    if after is None:
        return stream, None
    try:
        return stream, int(after)
    except ValueError:
        raise _invalid(f"Input should be a valid integer, unable to parse string as an integer: {after!r}",
                       "starting_after") from None


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": details.get(
                "created_cache_tokens", usage["prompt_tokens"] - cached),
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": usage["total_tokens"]}


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def _discard(message: dict[str, Any]) -> None:
    pass
