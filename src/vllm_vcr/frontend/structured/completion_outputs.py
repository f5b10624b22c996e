"""Structured outputs on `/v1/completions`: vLLM's completion-request checks, then each choice's
text (an instance of the constraint) as planned output ids, as chat does for its answers."""

from __future__ import annotations

import secrets
from typing import Any

from ..request_checks import check_structured_outputs_params
from .budget import checked_constraint, checked_request_constraints, generated_text
from .constraints import Constraint
from .instances import InstanceError


class CompletionOutputPlan:
    """The constraint of one completion request (`response_format` wins over `structured_outputs`)."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint

    @classmethod
    async def for_request(cls, req: Any) -> CompletionOutputPlan | None:
        """vLLM's checks (400s before anything reaches the engine), within the structured-output
        budgets; None without a constraint."""
        response_format = req.response_format
        if response_format is None and req.structured_outputs is None:
            return None
        await checked_request_constraints({"response_format": response_format,
                                           "structured_outputs": req.structured_outputs}, None, completion=True)
        check_structured_outputs_params(req.structured_outputs)
        constraint = await checked_constraint(response_format, req.structured_outputs)
        return cls(constraint) if constraint is not None else None

    async def plan(self, tokenizer: Any, seed: int | None, engine_reqs: list[Any]) -> None:
        """Each choice's planned ids (choice j draws with seed + j, as vLLM seeds n)."""
        from ..planned_output import attach_planned_ids

        for j, er in enumerate(engine_reqs):
            ids = await self.output_ids(tokenizer, None if seed is None else seed + j)
            if ids is not None:
                attach_planned_ids(er, ids)

    async def output_ids(self, tokenizer: Any, seed: int | None) -> list[int] | None:
        """The text's ids then EOS; None (free text) when no instance can be generated."""
        from ..chat_outputs import instance_text

        seed = secrets.randbits(32) if seed is None else seed
        try:
            text = await generated_text(self.constraint.kind, self.constraint.value, instance_text, self.constraint,
                                        seed)
        except InstanceError:
            return None
        if text is None:
            return None
        eos = tokenizer.eos_token_id
        return tokenizer.encode(text, add_special_tokens=False) + ([eos] if eos is not None else [])
