"""vLLM 0.32 request checks that completions and chat share, in its words, made after parsing
(protocol.py has the request models' own and SamplingParams' checks): the prompt logprobs limit,
greedy sampling with n > 1, empty conversations.
"""

from __future__ import annotations

from typing import Any

from .protocol import RequestValueError

_GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy


def is_greedy(req: Any) -> bool:
    return req.temperature is not None and req.temperature < _GREEDY_EPS


def check_greedy_n(req: Any) -> None:
    """SamplingParams: greedy sampling has one answer only."""
    if is_greedy(req) and req.n > 1:
        raise RequestValueError(f"n must be 1 when using greedy sampling, got {req.n}.")


def check_conversation(messages: list[Any]) -> None:
    if not messages:
        raise RequestValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")


def effective_prompt_logprobs(req: Any, echo_k: int | None) -> int | None:
    """vLLM: prompt_logprobs, else with `echo` the request's (top_)logprobs."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return echo_k if req.echo else None
