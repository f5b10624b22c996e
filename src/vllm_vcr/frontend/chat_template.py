"""Jinja chat templates rendered the way transformers' `apply_chat_template` renders them, bounded.

A template is code. vLLM refuses templates sent in a request unless `--trust-request-chat-template`
is set (`check_request_template`); when they are allowed, or when the operator's own template
meets hostile messages, rendering is still bounded:

* size: every value a template builds (operators `* ** % + ~`, calls, filters, the output) is
  checked against `MAX_OUTPUT_CHARS` *before* it is allocated where the size is known in advance
  (repeat counts, padding widths), so `'a' * 300000000` fails at once instead of taking 1.3 GB;
* time and memory: `render_isolated` renders a request's template in a worker process
  (isolated.py) that is killed after `RENDER_TIMEOUT` seconds, C-level calls included
  (`([[1]*1000]*2000)|sum(start=[])` spends its time inside one call), and runs under a memory
  limit; the event loop never waits for it.
"""

from __future__ import annotations

import functools
import json
import operator
import re
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .isolated import BudgetExceeded, IsolatedPool

MAX_OUTPUT_CHARS = 4_000_000  # a prompt far beyond any context; the bound on every built value
MAX_TEMPLATE_CHARS = 1_000_000  # a request's template source
RENDER_TIMEOUT = 2.0  # seconds a request-supplied template may render
MAX_EXPONENT_BITS = 4096  # `a ** b` results, in bits

UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")

# a printf/format width or precision of 7+ digits (or one taken from an argument) pads to megabytes
_HUGE_WIDTH = re.compile(r"%[-+ #0]*(?:\d{7,}|\*)|%[-+ #0]*\d*\.(?:\d{7,}|\*)|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


class ChatTemplateError(ValueError):
    """The template raised (raise_exception) or failed to render: a 400 for the client."""


class TemplateLimitError(ChatTemplateError):
    """The template exceeded a size or time bound."""


def check_request_template(chat_template: Any, chat_template_kwargs: dict[str, Any] | None, trusted: bool) -> None:
    """vLLM's rule: a template in the request (or in its chat_template_kwargs) needs the flag."""
    if trusted:
        return
    if chat_template is not None or (chat_template_kwargs and chat_template_kwargs.get("chat_template") is not None):
        raise ChatTemplateError(UNTRUSTED_TEMPLATE)


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"chat template failed to render: {what} exceeds {MAX_OUTPUT_CHARS} characters")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        raise _too_big("a value")
    return value


def _check_args(args: tuple, kwargs: dict[str, Any]) -> None:
    # widths and repeat counts are what make one call allocate megabytes (center, indent, ljust...)
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _too_big(f"argument {v}")
        if isinstance(v, str) and _HUGE_WIDTH.search(v):
            raise _too_big("a format width")


def _repeat_size(left: Any, right: Any) -> int:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int):
            return len(seq) * max(count, 0)
    return 0


def _bounded_pow(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left).bit_length() * right > MAX_EXPONENT_BITS:
        raise _too_big("a power")
    return left ** right


def _bounded_join(parts: Any) -> str:
    parts = [str(p) for p in parts]
    if sum(len(p) for p in parts) > MAX_OUTPUT_CHARS:
        raise _too_big("a concatenation")
    return "".join(parts)


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` joins through the environment, where its size is checked first."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        if frame.eval_ctx.autoescape or frame.eval_ctx.volatile:
            super().visit_Concat(node, frame)
            return
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    bounded_join = staticmethod(_bounded_join)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            if _repeat_size(left, right) > MAX_OUTPUT_CHARS:
                raise _too_big("a repetition")
            return _check_size(operator.mul(left, right))
        if op == "**":
            return _bounded_pow(left, right)
        if op == "%":
            if isinstance(left, str) and _HUGE_WIDTH.search(left):
                raise _too_big("a format width")
            return _check_size(operator.mod(left, right))
        if hasattr(left, "__len__") and hasattr(right, "__len__") \
                and isinstance(left, (str, list, tuple)) and len(left) + len(right) > MAX_OUTPUT_CHARS:
            raise _too_big("a concatenation")
        return operator.add(left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_args(args[1:] if args else args, kwargs)
        return _check_size(fn(*args, **kwargs))

    return wrapper


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' own tojson: no HTML escaping (jinja's default would turn < into \u003c)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for
    training masks): the body renders as it is, as in transformers' renders for a prompt."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_env: BoundedEnvironment | None = None


def _environment() -> BoundedEnvironment:
    global _env
    if _env is None:
        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
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
        except RecursionError:
            raise ChatTemplateError("invalid chat template: nested too deeply") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", tools: Any = None, documents: Any = None,
               **kwargs: Any) -> str:
        try:
            size = 0
            parts = []
            for chunk in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                    eos_token=eos_token, tools=tools, documents=documents, **kwargs):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise _too_big("the rendered prompt")
                parts.append(chunk)
            return "".join(parts)
        except ChatTemplateError:
            raise
        except (MemoryError, RecursionError) as e:
            raise TemplateLimitError(f"chat template failed to render: {type(e).__name__}") from None
        except Exception as e:  # any template runtime error is the request's fault
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None


def compile_request_template(source: Any) -> ChatTemplate:
    if not isinstance(source, str):
        raise ChatTemplateError("chat_template must be a string")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"chat template is longer than {MAX_TEMPLATE_CHARS} characters")
    return ChatTemplate(source)


# request templates render in worker processes: a C-level call (`sum` of lists, a sort) cannot be
# stopped in a thread and would hold the GIL, so the worker is killed at the deadline instead
POOL = IsolatedPool(workers=2, memory_mb=512, recycle_mb=128, preload=["vllm_vcr.frontend.chat_template"])


def render_request_template(source: Any, messages: list[dict[str, Any]], render: dict[str, Any]) -> str:
    """Compile a request's template and render it (in a worker process: `render_isolated`)."""
    return compile_request_template(source).render(messages, **render)


async def render_isolated(source: Any, messages: list[dict[str, Any]], timeout: float | None = None,
                          **render: Any) -> str:
    """`render_request_template` in a worker process that is killed `timeout` seconds after it
    starts (or when the awaiting task is cancelled); its memory is bounded there too."""
    delay = RENDER_TIMEOUT if timeout is None else timeout
    try:
        return await POOL.run(render_request_template, source, messages, render, timeout=delay)
    except BudgetExceeded as e:
        if e.reason == "time":
            raise TemplateLimitError(f"chat template failed to render: took longer than {delay:g}s") from None
        raise TemplateLimitError(f"chat template failed to render: needed more than {POOL.memory_mb} MiB") from None
