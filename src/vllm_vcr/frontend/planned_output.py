"""Planned output ids: the frontend decides what a constrained request generates (a tool call,
a schema instance), the engine emits exactly those ids through its `token_source_factory` hook.

The ids travel in `sampling_params.extra_args[PLANNED_OUTPUT_KEY]` (in-process with `serve`).
After them (say `ignore_eos` keeps the request going) the engine's usual random ids follow.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ..engine.tokens import PLANNED_OUTPUT_KEY, RandomTokens, ScriptedTokens, TokenSource


def planned_token_source(vocab_size: int, avoid: frozenset[int] = frozenset()) -> Callable[[Any, random.Random],
                                                                                           TokenSource | None]:
    """An EngineCore `token_source_factory`: planned ids for requests that carry them, else None
    (the engine picks its default source)."""

    def factory(req: Any, rng: random.Random) -> TokenSource | None:
        extra = req.sampling_params.extra_args if req.sampling_params is not None else None
        ids = extra.get(PLANNED_OUTPUT_KEY) if extra else None
        if ids is None:
            return None
        skip = avoid | ({req.eos_token_id} if req.eos_token_id is not None else set())
        return ScriptedTokens(list(ids), RandomTokens(rng, vocab_size, frozenset(skip)))

    return factory


def attach_planned_ids(engine_request: Any, ids: list[int]) -> None:
    sp = engine_request.sampling_params
    sp.extra_args = {**(sp.extra_args or {}), PLANNED_OUTPUT_KEY: ids}
