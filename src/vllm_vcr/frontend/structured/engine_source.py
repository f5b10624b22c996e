"""Constrained output on the engine side (`vllm-vcr play` behind a real vLLM frontend).

The real frontend sends its constraint in `sampling_params.structured_outputs` (json / regex /
choice / json_object, or a structural tag: how tool parsers force and shape calls). This
`token_source_factory` turns it into the ids of a text that satisfies it, with the model's
tokenizer, then EOS; requests without a constraint keep the engine's own source.

A structural tag is written whole by `structural_tag.structural_tag_instance` (both shapes, the
format tree; grammars by `grammar.grammar_instance`). A tag it has no generator for (token-level
formats, XML argument styles) is read generically instead: every tag with a `begin`, a
JSON-schema `content` and an `end` is a call the model may write (e.g. hermes'
`<tool_call>\\n{"name": "f", "arguments": ` ... `}\\n</tool_call>`); one of them is written,
filled with an instance of its schema.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from typing import Any

from ...engine.tokens import RandomTokens, ScriptedTokens, TokenSource
from ..chat_outputs import instance_text
from ..tools.prompt_calls import prompt_call_text, prompt_tool_schemas
from .constraints import request_constraint
from .instances import InstanceError, dump_json, json_instance
from .structural_tag import structural_tag_instance

logger = logging.getLogger("vllm_vcr.structured")


def _tags(node: Any) -> list[dict[str, Any]]:
    """Tags with begin / JSON-schema content / end anywhere in a structural-tag document."""
    found = []
    if isinstance(node, dict):
        content = node.get("content")
        if isinstance(node.get("begin"), str) and isinstance(node.get("end"), str) and isinstance(content, dict):
            found.append(node)
        for v in node.values():
            found += _tags(v)
    elif isinstance(node, list):
        for v in node:
            found += _tags(v)
    return found


_FREE = {"type": "object"}


def _schema_of(content: dict[str, Any]) -> Any:
    """The tag's argument schema; a free one (`true`: the tool is not strict) is written as a
    small object, as a model writes arguments."""
    for key in ("json_schema", "schema"):
        if isinstance(content.get(key), dict):
            return content[key]
    return _FREE


def structural_tag_text(tag_json: str, seed: int, prompt_schemas: dict[str, Any] | None = None) -> str | None:
    """A text that one tag of the structural tag accepts; None when no tag can be filled. A tag
    whose content is free (the tool is not strict) is filled per the tool's schema in the prompt
    (`prompt_schemas`, by the tool name its `begin` writes), as a model writes its arguments."""
    try:
        doc = json.loads(tag_json)
    except ValueError:
        return None
    tags = _tags(doc)
    if not tags:
        return None
    tag = tags[random.Random(seed).randrange(len(tags))]
    schema = _schema_of(tag["content"])
    if schema == _FREE and prompt_schemas:
        schema = next((s for n, s in prompt_schemas.items() if json.dumps(n) in tag["begin"]), schema)
    value = json_instance(schema, seed)
    return tag["begin"] + dump_json(value) + tag["end"]


_LITERAL = r'"(?:[^"\\]|\\.)*"'
_CHOICE_GRAMMAR = re.compile(rf"\s*root\s*::=\s*({_LITERAL}(?:\s*\|\s*{_LITERAL})*)\s*")


def grammar_choices(grammar: str) -> list[str] | None:
    """The literals of `root ::= "a" | "b"`: the grammar vLLM's frontend makes of a `choice`."""
    m = _CHOICE_GRAMMAR.fullmatch(grammar)
    if m is None:
        return None
    try:
        return [json.loads(lit) for lit in re.findall(_LITERAL, m.group(1))]
    except ValueError:
        return None


def constrained_text(structured: dict[str, Any], seed: int, prompt_schemas: dict[str, Any] | None = None) -> str | None:
    if structured.get("structural_tag"):
        return _structural_tag_answer(structured["structural_tag"], seed, prompt_schemas)
    if structured.get("grammar") and structured.get("choice") is None:
        choices = grammar_choices(structured["grammar"])
        if choices:
            structured = {"choice": choices}
    fields = {k: structured.get(k) for k in ("json", "regex", "choice", "grammar", "json_object")
              if structured.get(k) is not None}
    constraint = request_constraint(None, fields) if fields else None
    return instance_text(constraint, seed) if constraint is not None else None


def _structural_tag_answer(tag_json: str, seed: int, prompt_schemas: dict[str, Any] | None) -> str | None:
    """The whole format's text; a format with no generator falls back to filling one of its tags.
    A tool call (the prompt offers tools) is filled by the tag filler, which takes arguments the
    tag leaves unconstrained from the tool's schema in the prompt."""
    if prompt_schemas:
        return structural_tag_text(tag_json, seed, prompt_schemas)
    try:
        return structural_tag_instance(tag_json, seed)
    except InstanceError:
        return structural_tag_text(tag_json, seed)


def constrained_token_source(tokenizer: Any, vocab_size: int) -> Callable[[Any, random.Random], TokenSource | None]:
    """An EngineCore `token_source_factory` for requests carrying `structured_outputs` (or, unconstrained,
    a prompt that offers tools: tools/prompt_calls.py)."""
    eos = tokenizer.eos_token_id
    vocab = tokenizer.hf.get_vocab()

    def factory(req: Any, rng: random.Random) -> TokenSource | None:
        sp = req.sampling_params
        structured = getattr(sp, "structured_outputs", None) if sp is not None else None

        def draw_seed() -> int:  # drawn only when needed: free-text requests keep their random stream
            return sp.seed if sp is not None and sp.seed is not None else rng.getrandbits(32)

        def prompt() -> str:
            return tokenizer.decode(getattr(req, "prompt_token_ids", None) or [], skip_special_tokens=False)

        if not structured:  # unconstrained: a tool call if the prompt offers tools
            text = prompt_call_text(prompt(), vocab, draw_seed)
            return _scripted(text, rng) if text is not None else None
        seed = draw_seed()
        try:
            text = constrained_text(structured, seed, prompt_tool_schemas(prompt())
                                    if structured.get("structural_tag") else None)
        except (InstanceError, ValueError) as e:
            logger.warning("request %s: cannot satisfy its structured outputs (%s); free text", req.request_id, e)
            return None
        return _scripted(text, rng) if text is not None else None

    def _scripted(text: str, rng: random.Random) -> TokenSource:
        ids = tokenizer.encode(text, add_special_tokens=False) + ([eos] if eos is not None else [])
        return ScriptedTokens(ids, RandomTokens(rng, vocab_size, frozenset({eos} if eos is not None else ())))

    return factory
