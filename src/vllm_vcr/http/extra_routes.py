"""The generative routes beyond completions and chat, registered on the app in one place:
the Responses API, Anthropic Messages, the Cohere-compatible routes, /invocations, and the
tokens-in/tokens-out endpoints of --enable-scale-out / --tokens-only."""

from __future__ import annotations

from typing import Any

Methods = dict[str, tuple[Any, bool]]


def add_generative_routes(app: Any) -> list[tuple[str, str, Methods]]:
    """Adds exact routes to `app.routes`; returns the (prefix, suffix, methods) routes with an id
    in the path, for `match_route`."""
    from .responses.serving import ResponsesServing
    from .serving_messages import MessagesServing

    app.responses = ResponsesServing(app.chat)
    app.messages = MessagesServing(app.chat)
    app.routes["/v1/responses"] = {"POST": (app.responses.create, True)}
    app.routes["/v1/messages"] = {"POST": (app.messages.create, True)}
    app.routes["/v1/messages/count_tokens"] = {"POST": (app.messages.count_tokens, False)}
    return [
        ("/v1/responses/", "/cancel", {"POST": (app.responses.cancel, False)}),
        ("/v1/responses/", "", {"GET": (app.responses.retrieve, False)}),
    ]


def match_route(routes: list[tuple[str, str, Methods]], path: str) -> Methods | None:
    for prefix, suffix, methods in routes:
        if path.startswith(prefix) and path.endswith(suffix):
            middle = path[len(prefix): len(path) - len(suffix)]
            if middle and "/" not in middle:
                return methods
    return None
