"""Jinja chat templates rendered the way transformers' `apply_chat_template` renders them."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised (raise_exception) or failed to render: a 400 for the client."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' own tojson: no HTML escaping (jinja's default would turn < into \u003c)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_env: ImmutableSandboxedEnvironment | None = None


def _environment() -> ImmutableSandboxedEnvironment:
    global _env
    if _env is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _env = env
    return _env


class ChatTemplate:
    """A compiled template; `render` takes the same variables transformers passes."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"invalid chat template: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", tools: Any = None, documents: Any = None,
               **kwargs: Any) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token, tools=tools, documents=documents, **kwargs)
        except ChatTemplateError:
            raise
        except Exception as e:  # any template runtime error is the request's fault
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
