"""The generative routes beyond completions and chat, registered on the app in one place:
the Responses API, Anthropic Messages, /invocations, and the tokens-in/tokens-out endpoints of
--enable-scale-out / --tokens-only. (vLLM's Cohere v2 chat is opt-in there and not offered.)"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from ..frontend.errors import HTTPError, bad_request
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest
from ..openai.responses.serving import ResponsesServing
from ..anthropic.messages import MessagesServing
from ..vllm.render import RenderServing
from ..vllm.tokens import SCALE_OUT_ROUTES, TokensServing, scale_out_disabled

# imported with the app, not when it is built: the listening socket is already bound by then

Methods = dict[str, tuple[Any, bool]]


def add_generative_routes(app: Any) -> list[tuple[str, str, Methods]]:
    """Adds exact routes to `app.routes`; returns the (prefix, suffix, methods) routes with an id
    in the path, for `match_route`."""
    app.responses = ResponsesServing(app.chat)
    app.messages = MessagesServing(app.chat)
    app.routes["/v1/responses"] = {"POST": (app.responses.create, True)}
    app.routes["/v1/messages"] = {"POST": (app.messages.create, True)}
    app.routes["/v1/messages/count_tokens"] = {"POST": (app.messages.count_tokens, False)}
    app.routes["/invocations"] = {"POST": (_invocations(app), True)}
    _add_scale_out(app)
    return [
        ("/v1/responses/", "/cancel", {"POST": (app.responses.cancel, False)}),
        ("/v1/responses/", "", {"GET": (app.responses.retrieve, False)}),
    ]


def _add_scale_out(app: Any) -> None:
    if not app.settings.scale_out:
        for path in SCALE_OUT_ROUTES:
            app.routes[path] = {"POST": (scale_out_disabled, False)}
        return
    app.tokens = TokensServing(app.engine, app.tokenizer, app.settings, app.metrics)
    app.render = RenderServing(app)
    app.routes["/inference/v1/generate"] = {"POST": (app.tokens.generate, True)}
    app.routes["/inference/v1/abort_requests"] = {"POST": (app.tokens.abort_requests, False)}
    for path, handler in app.render.routes().items():
        app.routes[path] = {"POST": (handler, False)}


def _invocations(app: Any) -> Any:
    """SageMaker's /invocations: the body is a chat request or else a completion request (the
    first request model that validates it wins, as in vLLM)."""

    async def invocations(ctx: Any) -> None:
        try:
            json.loads(ctx.body)
        except ValueError as e:
            raise HTTPError(400, f"JSON decode error: {e}", "Bad Request") from None
        for model, handler in ((ChatCompletionRequest, app.chat.handle), (CompletionRequest, app.completions.handle)):
            try:
                model.model_validate_json(ctx.body)
            except ValidationError:
                continue
            return await handler(ctx)
        raise bad_request("Cannot find suitable handler for request. Expected one of: "
                          "['ChatCompletionRequest', 'CompletionRequest']")

    return invocations


def match_route(routes: list[tuple[str, str, Methods]], path: str) -> Methods | None:
    for prefix, suffix, methods in routes:
        if path.startswith(prefix) and path.endswith(suffix):
            middle = path[len(prefix): len(path) - len(suffix)]
            if middle and "/" not in middle:
                return methods
    return None
