"""vLLM 0.32's request checks, in its words, made after parsing and shared by every API family:
the output budget and the prompt's length against the context, SamplingParams' checks (sampling
values, stop strings, logprobs limits, greedy sampling with n > 1), empty conversations.
(protocol.py has the request models and the checks their own validators make.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from .protocol import MAX_LOGPROBS, MAX_N, RequestValueError, stop_list, token_choice_params

OFFLOAD_BIAS_ENTRIES = 10_000  # a logit_bias this large is checked in a worker thread

_GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy


def is_greedy(req: Any) -> bool:
    return req.temperature is not None and req.temperature < _GREEDY_EPS


def sampling_values(req: Any) -> dict[str, float | int]:
    """temperature, top_p, top_k and min_p as vLLM's SamplingParams holds them: OpenAI's defaults
    for what the request leaves unset, and greedy sampling's own (a greedy request has no top_p,
    top_k or min_p: SamplingParams resets them)."""
    if is_greedy(req):
        return {"temperature": req.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    return {"temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": getattr(req, "top_k", None) or 0,
            "min_p": getattr(req, "min_p", None) or 0.0}


def check_greedy_n(req: Any) -> None:
    """SamplingParams: greedy sampling has one answer only."""
    if is_greedy(req) and req.n > 1:
        raise RequestValueError(f"n must be 1 when using greedy sampling, got {req.n}.")


async def check_token_choice(req: Any, vocab_size: int) -> None:
    """`logit_bias` / `allowed_token_ids` against the vocabulary (protocol.token_choice_params,
    vLLM's words); a large one in a worker thread, so that the event loop keeps serving. A valid
    `logit_bias` has at most one entry per token, so the one built per choice later is small."""
    bias = getattr(req, "logit_bias", None) or {}
    allowed = getattr(req, "allowed_token_ids", None) or []
    if len(bias) + len(allowed) > OFFLOAD_BIAS_ENTRIES:
        ids, _ = await asyncio.to_thread(token_choice_params, req, vocab_size)
        if ids is not None and len(ids) < len(bias):  # keys naming one id twice ("1", "01"), folded as vLLM does
            req.logit_bias = {str(k): v for k, v in ids.items()}
    else:
        token_choice_params(req, vocab_size)


def check_conversation(messages: list[Any]) -> None:
    if not messages:
        raise RequestValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")


def effective_prompt_logprobs(req: Any, echo_k: int | None) -> int | None:
    """vLLM: prompt_logprobs, else with `echo` the request's (top_)logprobs."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return echo_k if req.echo else None


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def check_sampling(req: Any, max_tokens: int | None) -> None:
    """SamplingParams' own checks, in vLLM's order and wording; `max_tokens` is the value after
    clamping to the context (so a prompt that fills the context reports max_tokens 0)."""
    n = req.n
    if n < 1:
        raise RequestValueError(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise RequestValueError(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
                                "VLLM_MAX_N_SEQUENCES environment variable.")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise RequestValueError(f"{name} must be in [-2, 2], got {v}.")
    rp = req.repetition_penalty
    if rp is not None:
        if not _finite(rp):
            raise RequestValueError(f"repetition_penalty must be a finite number, got {rp}.")
        if rp <= 0.0:
            raise RequestValueError(f"repetition_penalty must be greater than zero, got {rp}.")
    t = req.temperature
    if t is not None:
        if not _finite(t):
            raise RequestValueError(f"temperature must be a finite number, got {t}.", "temperature", t)
        if t < 0.0:
            raise RequestValueError(f"temperature must be non-negative, got {t}.", "temperature", t)
        if t > 2.0:
            raise RequestValueError(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise RequestValueError(f"top_p must be in (0, 1], got {req.top_p}.", "top_p", req.top_p)
    if req.top_k is not None and req.top_k < -1:
        raise RequestValueError(f"top_k must be 0 (disable), or at least 1, got {req.top_k}.")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise RequestValueError(f"min_p must be in [0, 1], got {req.min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise RequestValueError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if req.min_tokens < 0:
        raise RequestValueError(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise RequestValueError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.")
    if any(not s for s in stop_list(req.stop)):
        raise RequestValueError("stop cannot contain an empty string.")
    if req.use_beam_search:
        raise RequestValueError("beam search is not supported by vllm-vcr.", "use_beam_search")


def check_logprobs_limit(num: int | None) -> None:
    """The engine's --max-logprobs check (vLLM's default 20)."""
    if num is not None and num > MAX_LOGPROBS:
        raise RequestValueError(f"Requested sample logprobs of {num}, which is greater than max allowed: "
                                f"{MAX_LOGPROBS}", "logprobs", num)


def check_prompt_logprobs_limit(value: int | None, vocab_size: int) -> None:
    """SamplingParams' check against --max-logprobs (-1 means the whole vocabulary)."""
    if not value:
        return
    num = vocab_size if value == -1 else value
    if num > MAX_LOGPROBS:
        raise RequestValueError(f"Requested prompt logprobs of {num}, which is greater than max allowed: "
                                f"{MAX_LOGPROBS}", "prompt_logprobs", num)


MAX_PROMPT_LOGPROB_ENTRIES = 200_000  # per request: about 80 MB of response objects, 10 MB of JSON


def check_prompt_logprobs_budget(value: int | None, prompt_tokens: int, vocab_size: int) -> None:
    """This server's bound on the prompt logprobs of one request (vLLM has none, and pays for them
    on the GPU): each prompt token after the first gets k + 1 entries, and every choice carries
    its prompt's. Over it the request fails before anything is generated."""
    if value is None:
        return
    k = vocab_size if value == -1 else value
    entries = max(prompt_tokens, 0) * (k + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise RequestValueError(f"Requested prompt logprobs for {prompt_tokens} prompt tokens with {k} logprobs each "
                                f"({entries} entries), which is greater than max allowed per request: "
                                f"{MAX_PROMPT_LOGPROB_ENTRIES}", "prompt_logprobs", value)


def check_output_budget(max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """vLLM's renderer: more output tokens than the whole context is a 400 before tokenizing."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise RequestValueError(f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                                "Please request fewer output tokens.", param, max_tokens)


def check_prompt_tokens(prompt_len: int, max_model_len: int, from_text: bool) -> None:
    """vLLM's renderer: a prompt longer than the context is a 400. vLLM tokenizes text with
    truncation at max_model_len + 1 tokens, so for text it can only say "at least"."""
    if prompt_len > max_model_len:
        count = max_model_len + 1 if from_text else prompt_len
        qualifier = "at least " if from_text else ""
        raise RequestValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.", "input_tokens", count)


def check_prompt_chars(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    """vLLM's cheap pre-check on text that cannot fit whatever it tokenizes to."""
    limit = max_model_len * max_chars_per_token
    if len(text) > limit:
        raise RequestValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(text)} characters (more than {limit} characters, which is the upper bound for "
            f"{max_model_len} input tokens). Please reduce the length of the input prompt.",
            "input_text", len(text))


# vLLM's StructuredOutputsParams: its fields (in order), their defaults, and the constraint kinds
_SO_FIELDS = (("json", None), ("regex", None), ("choice", None), ("grammar", None), ("json_object", None),
              ("disable_any_whitespace", False), ("disable_additional_properties", False),
              ("whitespace_pattern", None), ("structural_tag", None), ("_backend", None),
              ("_backend_was_auto", False))
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def check_structured_outputs_params(so: dict[str, Any] | None) -> None:
    """StructuredOutputsParams.__post_init__: exactly one kind of constraint (unknown keys are
    dropped, as the dataclass drops them); the message shows the dataclass's fields."""
    if not isinstance(so, dict):
        return
    count = sum(so.get(k) is not None for k in _SO_KINDS)
    if count == 1:
        return
    fields = {k: (default if k.startswith("_") else so.get(k, default)) for k, default in _SO_FIELDS}
    which = "multiple are" if count > 1 else "none are"
    raise RequestValueError(f"You {'can only' if count > 1 else 'must'} use one kind of structured outputs "
                            f"constraint but {which} specified: {fields}")


def check_truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> None:
    """vLLM's TokenizeParams: a truncation size above the context is a 400 (checked with the
    output budget, before tokenizing)."""
    if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_model_len:
        raise RequestValueError(f"truncate_prompt_tokens={truncate_prompt_tokens} cannot be greater than "
                                f"max_model_len = {max_model_len}. Please request a smaller truncation size.",
                                "truncate_prompt_tokens", truncate_prompt_tokens)


def truncate_prompt(ids: list[int], truncate_prompt_tokens: int | None, side: str | None, max_model_len: int,
                    pooling: bool = False, specials: tuple[int, int] = (0, 0)) -> list[int]:
    """vLLM's prompt truncation: keep the last N tokens (`truncation_side` "right": the first N);
    -1 means the whole context, less one token left for output on a generative request. A text
    prompt is truncated by the tokenizer, which keeps the special tokens it adds: `specials` is
    (how many lead, how many trail) the prompt, kept outside the cut. An empty result is vLLM's
    "The decoder prompt cannot be empty"."""
    keep = truncate_prompt_tokens
    if keep is None:
        return ids
    if keep < 0:
        keep = max_model_len if pooling else max(0, max_model_len - 1)
    if keep >= len(ids):
        return ids
    lead, trail = specials
    body = ids[lead:len(ids) - trail]
    room = keep - lead - trail
    if room <= 0 or not body:
        lead = trail = 0
        body, room = ids, keep
    cut = [] if room == 0 else body[-room:] if (side or "left") == "left" else body[:room]
    ids = ids[:lead] + cut + (ids[len(ids) - trail:] if trail else [])
    if not ids:
        raise RequestValueError("The decoder prompt cannot be empty")
    return ids
