"""The Anthropic family's routes: Messages and token counting."""

from __future__ import annotations

from typing import Any

from ..http.routes import GENERATE, Family, Route, RouteConfig
from .messages import MessagesServing


def services(app: Any, config: RouteConfig) -> None:
    app.messages = MessagesServing(app.chat)


FAMILY = Family("anthropic", services=services, about="Anthropic Messages API", routes=(
    Route("/v1/messages", ("POST",), lambda a: a.messages.create, GENERATE, generation=True, json_only=True,
          doc="Anthropic Messages ([serve-api.md](serve-api.md))"),
    Route("/v1/messages/count_tokens", ("POST",), lambda a: a.messages.count_tokens, json_only=True,
          doc="the prompt's token count"),
))
