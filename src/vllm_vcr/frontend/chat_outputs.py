"""What a chat request with tools or an output constraint generates, and how its text reads back.

`ChatOutputPlan.for_request` returns None for plain requests (they never come here). Otherwise
it runs vLLM's request checks, then plans each choice's output ids (a tool call in the parser's
format, an instance of the constraint, optionally after a thinking span) and turns the text the
engine produced back into `content` / `tool_calls` the way vLLM's parsers do.
"""

from __future__ import annotations

import secrets
from typing import Any

from .protocol import ChatCompletionRequest
from .request_checks import check_structured_outputs_params
from .structured.budget import checked_constraint, checked_request_constraints, generated_text
from .structured.constraints import Constraint, check_request_constraints
from .structured.grammar import grammar_instance
from .structured.instances import InstanceError, choice_instance, dump_json, json_instance, regex_instance
from .structured.structural_tag import structural_tag_instance
from .tools.calls import (
    ToolSettings,
    check_tool_gates,
    check_tool_usage,
    effective_tool_choice,
    extract_calls,
    named_choice,
    plan_calls,
    render_calls,
)
from .tools.formats import ToolCallFormat, get_format


def plan_constraint_output(engine_request: Any, constraint: Constraint, seed: int | None, tokenizer: Any) -> None:
    """A token-in request's constraint: the engine emits the ids of an instance of it (then EOS).
    An instance that cannot be generated leaves the request unconstrained."""
    from .planned_output import attach_planned_ids

    try:
        text = instance_text(constraint, secrets.randbits(32) if seed is None else seed)
    except InstanceError:
        return
    if text is not None:
        eos = tokenizer.eos_token_id
        ids = tokenizer.encode(text, add_special_tokens=False)
        attach_planned_ids(engine_request, ids + ([eos] if eos is not None else []))


def instance_text(constraint: Constraint, seed: int) -> str | None:
    """Text satisfying the constraint (InstanceError when none can be generated)."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        return dump_json(json_instance(constraint.value, seed))
    if kind == "regex":
        return regex_instance(constraint.value, seed)
    if kind == "choice":
        return choice_instance(constraint.value, seed)
    if kind == "grammar":
        return grammar_instance(constraint.value, seed)
    if kind == "structural_tag":
        return structural_tag_instance(constraint.value, seed)
    return None


def planned_text(parser: str | None, tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
                 settings: ToolSettings, constraint: Constraint | None, seed: int) -> str | None:
    """One choice's text: the tool calls the model makes, else an instance of the constraint
    (runs in a budgeted worker process: structured/budget.py)."""
    if parser is not None and tools:
        calls = plan_calls(tools, tool_choice, parallel, seed, settings)
        if calls:
            return render_calls(get_format(parser), calls, tool_choice)
    return instance_text(constraint, seed) if constraint is not None else None


class ChatOutputPlan:
    def __init__(self, req: ChatCompletionRequest, tools: ToolSettings, reasoning_ids: tuple[int, int] | None,
                 checks: bool = True):
        # the request model's own checks in vLLM (check_structured_outputs_count, check_tool_usage);
        # for_request makes them within the structured-output budgets instead
        has_choice = "tool_choice" in req.model_fields_set
        self.tool_choice = effective_tool_choice(has_choice, req.tools, req.tool_choice)
        if checks:
            check_request_constraints(req, self.tool_choice)
            check_structured_outputs_params(req.structured_outputs)
            check_tool_usage(req.tools, req.tool_choice, has_choice)
        self.req = req
        self.settings = tools
        self.reasoning_ids = reasoning_ids
        self.constraint: Constraint | None = None
        self.fmt: ToolCallFormat | None = get_format(tools.parser) if tools.available else None

    @classmethod
    async def for_request(cls, req: ChatCompletionRequest, tools: ToolSettings,
                          reasoning_ids: tuple[int, int] | None) -> ChatOutputPlan | None:
        if req.tools is None and req.response_format is None and req.structured_outputs is None \
                and "tool_choice" not in req.model_fields_set:
            return None
        plan = cls(req, tools, reasoning_ids, checks=False)
        await checked_request_constraints(req, plan.tool_choice)
        check_structured_outputs_params(req.structured_outputs)
        check_tool_usage(req.tools, req.tool_choice, "tool_choice" in req.model_fields_set)
        return plan

    @property
    def uses_tools(self) -> bool:
        return self.fmt is not None and bool(self.req.tools) and self.tool_choice not in (None, "none")

    @property
    def named(self) -> str | None:
        return named_choice(self.tool_choice)

    async def check(self) -> None:
        """The renderer's tool gates, then the engine-side constraint checks (after the model check),
        within the structured-output budgets."""
        check_tool_gates(self.tool_choice, self.settings)
        self.constraint = await checked_constraint(self.req.response_format, self.req.structured_outputs)

    async def output_ids(self, tokenizer: Any, seed: int | None) -> list[int] | None:
        """The ids this choice generates; None leaves the engine's own source (free text)."""
        seed = secrets.randbits(32) if seed is None else seed
        uses_tools = self.uses_tools
        if not uses_tools and self.constraint is None:
            return None
        kind, value = ("json", self.req.tools) if uses_tools else (self.constraint.kind, self.constraint.value)
        try:
            text = await generated_text(kind, value, planned_text, self.settings.parser if uses_tools else None,
                                        self.req.tools if uses_tools else None, self.tool_choice,
                                        self.req.parallel_tool_calls, self.settings, self.constraint, seed)
        except InstanceError:
            return None  # a schema the generator cannot sample: the output is free text
        if text is None:
            return None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if self.reasoning_ids is not None:
            start, end = self.reasoning_ids
            ids = [start, *tokenizer.encode(self._thought(), add_special_tokens=False), end, *ids]
        eos = tokenizer.eos_token_id
        return ids + [eos] if eos is not None else ids

    def _thought(self) -> str:
        return "The user needs a tool for this." if self.uses_tools else "Let me write the answer."

    def message_parts(self, text: str | None) -> tuple[str | None, list[dict[str, Any]], bool]:
        """(content, tool_calls, auto tools called) as vLLM's chat serving builds the message."""
        if not self.uses_tools:
            return text, [], False
        content, calls = extract_calls(self.fmt, text or "", self.tool_choice) or (text, [])
        if self.req.parallel_tool_calls is False:
            calls = calls[:1]
        tool_calls = [{"id": self.fmt.call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        if self.tool_choice != "auto":
            return content or "", tool_calls, False
        return content, tool_calls, bool(tool_calls)

    def finish_reason(self, finish_reason: str | None, auto_called: bool) -> str | None:
        if auto_called or (self.tool_choice == "required" and finish_reason == "stop" and self.uses_tools):
            return "tool_calls"
        return finish_reason
