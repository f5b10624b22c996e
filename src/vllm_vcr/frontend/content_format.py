"""The shape a chat template expects message content in, as vLLM decides it.

vLLM hands a template each message's content in one of two shapes: `string` (the text parts
joined by newlines) or `openai` (a list of parts, `{"type": "text", "text": ...}`, a plain string
content becoming one such part). `--chat-template-content-format` names one; `auto` (the
default) reads the template's syntax tree: a template gets parts when it has a `for` loop over a
message's `content` (`message.content`, `message['content']`, through filters, tests and slices,
where `message` is the loop variable of a loop over `messages` or over a variable set from it,
a namespace attribute included), over a macro parameter a call passes a message's content to, or
over a variable named `content` outside a macro; strings otherwise, and when the template does
not parse.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Iterator

from jinja2 import nodes

from .chat_template import _environment

logger = logging.getLogger("vllm_vcr.serve")
_told: set[tuple[str, str]] = set()  # (given, detected) already logged, as vLLM logs each once


class _Unsupported(Exception):
    """A loop over messages or content whose target is not a single name: vLLM's detection stops
    at it and answers `string`."""


def resolve_content_format(given: str, template_source: str | None) -> str:
    """The format a template renders with: `given` unless it is `auto`, else the detected one."""
    detected = "string" if template_source is None else detect_content_format(template_source)
    if (given, detected) not in _told:
        _told.add((given, detected))
        if given == "auto":
            logger.info("Detected the chat template content format to be '%s'. You can set "
                        "`--chat-template-content-format` to override this.", detected)
        elif given != detected:
            logger.warning("You specified `--chat-template-content-format %s` which is different from the "
                           "detected format '%s'.", given, detected)
    return detected if given == "auto" else given


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> str:
    """`openai` for a template that loops over a message's content parts, else `string`."""
    try:
        tree = _environment().parse(source)
        return "openai" if _loops_over_content(tree) else "string"
    except Exception:  # noqa: BLE001 - a template that does not parse, or a shape the rule stops at
        return "string"


def _loops_over_content(tree: nodes.Template) -> bool:
    lists = _aliases(tree, "messages")
    message_vars = [_target(loop) for loop in tree.find_all(nodes.For) if _reads(loop.iter, lists)]
    param_loops, in_macros = _macro_content_loops(tree, message_vars)
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if _reads(it, message_vars, "content"):
            _target(loop)
            return True
        if isinstance(it, nodes.Name) and (it.name in param_loops.get(id(loop), ())
                                           or (it.name == "content" and id(loop) not in in_macros)):
            _target(loop)
            return True
    return False


def _target(loop: nodes.For) -> str:
    if not isinstance(loop.target, nodes.Name):
        raise _Unsupported
    return loop.target.name


def _aliases(tree: nodes.Template, name: str) -> list[str]:
    """`name` and every variable set from it, transitively (`ns.attr` for a namespace attribute)."""
    found, queue = [name], [name]
    while queue:
        source = queue.pop(0)
        for assign in tree.find_all(nodes.Assign):
            for alias in _assigned_from(assign, source):
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _assigned_from(assign: nodes.Assign, source: str) -> Iterator[str]:
    target, value = assign.target, assign.node
    if isinstance(target, nodes.Name):
        if _reads(value, [source]):
            yield target.name
        elif isinstance(value, nodes.Call) and isinstance(value.node, nodes.Name) and value.node.name == "namespace":
            yield from (f"{target.name}.{kw.key}" for kw in value.kwargs if _reads(kw.value, [source]))
    elif isinstance(target, (nodes.NSRef, nodes.Getattr)) and _reads(value, [source]):
        dotted = _dotted(target)
        if dotted is not None:
            yield dotted


def _dotted(node: nodes.Node) -> str | None:
    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs = []
    while isinstance(node, nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    return ".".join([node.name, *reversed(attrs)]) if isinstance(node, nodes.Name) else None


def _reads(node: nodes.Node | None, names: list[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or its `key` item), possibly filtered, tested or sliced."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)):
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if node is None:
        return False
    if key is None:
        return _is_name(node, names)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _is_name(node.node, names)
    return isinstance(node, nodes.Getattr) and node.attr == key and _is_name(node.node, names)


def _is_name(node: nodes.Node, names: list[str]) -> bool:
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getattr):  # `ns.attr`, a namespace attribute set from messages
        return any("." in n and n.rpartition(".")[2] == node.attr and _is_name(node.node, [n.rpartition(".")[0]])
                   for n in names)
    return False


def _macro_content_loops(tree: nodes.Template, names: list[str]) -> tuple[dict[int, set[str]], set[int]]:
    """The loops inside macros (by id), and for those of a macro some call passes a message's
    content (of a message variable in `names`) to, that macro's parameters that receive it."""
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    calls = list(tree.find_all(nodes.Call))
    for macro in tree.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        bound: set[str] = set()
        for call in calls:
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            bound.update(params[i] for i, arg in enumerate(call.args[:len(params)]) if _reads(arg, names, "content"))
            bound.update(kw.key for kw in call.kwargs if kw.key in params and _reads(kw.value, names, "content"))
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if bound:
                by_loop[id(loop)] = bound
    return by_loop, in_macros
