"""What completions and chat share: engine requests, per-sequence output state, stream merging.

`SequenceState` turns engine outputs into text deltas the way vLLM's output processor does:
incremental detokenization, the final EOS/stop token left out of the text, stop strings matched
in the frontend (text truncated, finish_reason "stop", stop_reason the string, and the engine
request aborted by the caller), and a hold-back of `max(len(stop)) - 1` characters while
streaming so that a partial stop string is never sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from os import urandom as _urandom
from typing import Any

from ..engine.types import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from .errors import HTTPError, bad_request
from .protocol import RequestValueError, stop_list, token_choice_params
from .tokenizer import IncrementalDetokenizer, Tokenizer

_STOP = FinishReason.STOP
_FINISH_STR = {r: str(r) for r in FinishReason}


def random_hex(n: int = 32) -> str:
    return _urandom(n // 2).hex()  # secrets.token_hex without its two extra calls



def parse_dp_rank(headers: dict[bytes, bytes], engine_count: int) -> int | None:
    raw = headers.get(b"x-data-parallel-rank")
    if raw is None:
        return None
    try:
        rank = int(raw.decode("latin-1").strip())
    except ValueError:
        raise bad_request(f"Invalid X-data-parallel-rank header: {raw.decode('latin-1')!r} is not an integer.")

    if not 0 <= rank < engine_count:
        raise bad_request(f"data_parallel_rank {rank} is out of range [0, {engine_count}).")
    return rank


def output_replay_header(headers: dict[bytes, bytes]) -> str | None:
    """`X-Output-Replay-Id`: picks the request's row in a response replay table."""
    raw = headers.get(b"x-output-replay-id")
    if raw is None:
        return None
    return raw.decode("latin-1").strip() or None


def sglang_handoff(fields: Any) -> dict[str, Any] | None:
    """SGLang's P/D request fields as the handoff metadata of `kv_transfer_params`, or None.

    An SGLang router (smg, sgl-model-gateway) sends the same request to a prefill and a decode
    worker at once, adding top-level `bootstrap_host`, `bootstrap_port` (the prefill worker's
    bootstrap server) and `bootstrap_room` (a random u64 naming the transfer). The room is the
    handoff's id. Without a host, a port or a room it is a plain request, as SGLang serves it."""
    host, port, room = fields.get("bootstrap_host"), fields.get("bootstrap_port"), fields.get("bootstrap_room")
    if host is None or port is None or room is None:
        return None
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room, "handoff_id": f"room-{room}"}


def build_engine_request(
    *,
    internal_id: str,
    external_id: str,
    prompt_ids: list[int],
    req: Any,
    max_tokens: int,
    seed: int | None,
    logprobs: int | None,
    stream: bool,
    tokenizer: Tokenizer,
    dp_rank: int | None,
    replay_id: str | None = None,
    lora_request: Any = None,
    arrival_time: float | None = None,
    sglang_bootstrap: bool = False,
    sampling_params: SamplingParams | None = None,
) -> EngineCoreRequest:
    """`sglang_bootstrap`: the worker simulates SGLang, whose requests may carry its P/D fields
    (`sglang_handoff`). `sampling_params`: what this function made before from the same request
    and arguments (a handler that knows them to be the same may keep them: a copy each time)."""
    sp = sampling_params if sampling_params is not None else _sampling_params(
        req, max_tokens, seed, logprobs, stream, tokenizer, replay_id, sglang_bootstrap)
    return EngineCoreRequest(
        request_id=internal_id,
        prompt_token_ids=prompt_ids,
        sampling_params=sp,
        # the HTTP arrival (vLLM's arrival_time): the engine's TTFT includes our parsing and templating
        arrival_time=time.time() if arrival_time is None else arrival_time,
        cache_salt=req.cache_salt,
        data_parallel_rank=dp_rank,
        priority=int(req.priority),
        external_req_id=external_id,
        lora_request=lora_request,
    )


def _sampling_params(req: Any, max_tokens: int, seed: int | None, logprobs: int | None, stream: bool,
                     tokenizer: Tokenizer, replay_id: str | None, sglang_bootstrap: bool) -> SamplingParams:
    eos = tokenizer.eos_token_id
    stop_ids = list(req.stop_token_ids or [])
    all_stop = list(stop_ids)
    if eos is not None and not req.ignore_eos:
        all_stop.append(eos)
    gen_eos = tokenizer.generation_eos_ids
    if gen_eos:  # SamplingParams.update_from_generation_config (gen_eos: sorted, without duplicates)
        all_stop += [i for i in gen_eos if i not in all_stop]
        if not req.ignore_eos:
            stop_ids = sorted(set(gen_eos).union(stop_ids)) if stop_ids else list(gen_eos)
    extra = dict(req.vllm_xargs) if req.vllm_xargs else {}
    if req.kv_transfer_params:
        extra["kv_transfer_params"] = req.kv_transfer_params
    elif sglang_bootstrap and (handoff := sglang_handoff(req.model_extra or {})) is not None:
        extra["kv_transfer_params"] = handoff
    if replay_id is not None:
        extra.setdefault("output_replay_id", replay_id)  # vllm_xargs wins over the header
    logit_bias, allowed_token_ids = token_choice_params(req, tokenizer.vocab_size)
    return SamplingParams(
        n=1,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None else int(req.top_k),
        seed=seed,
        stop=stop_list(req.stop) or None,
        stop_token_ids=stop_ids or None,
        ignore_eos=bool(req.ignore_eos),
        max_tokens=max_tokens,
        min_tokens=int(req.min_tokens),
        logprobs=logprobs,
        output_kind=1 if stream else 2,  # RequestOutputKind.DELTA / FINAL_ONLY
        extra_args=extra or None,
        eos_token_id=eos,
        all_stop_token_ids=all_stop,
        logit_bias=logit_bias,
        allowed_token_ids=allowed_token_ids,
    )


def as_http_error(e: RequestValueError) -> HTTPError:
    return bad_request(str(e), e.param)


class SequenceState:
    """One output sequence (one choice)."""

    __slots__ = ("detok", "tokenizer", "stops", "max_stop", "holdback", "include_stop", "min_tokens",
                 "keep_text", "text", "sent", "parts", "num_tokens", "finish_reason", "stop_reason",
                 "cached_tokens", "token_ids", "want_logprobs", "keep_ids", "finished",
                 "by_frontend", "kv_transfer_params", "cache_created", "think", "phase", "reasoning",
                 "reasoning_delta", "reasoning_tokens", "rdetok", "error")

    def __init__(self, tokenizer: Tokenizer, *, stop: list[str], include_stop: bool, min_tokens: int,
                 streaming: bool, want_logprobs: int | None, keep_ids: bool = False,
                 think: tuple[int, int] | None = None):
        self.tokenizer = tokenizer
        self.error = None
        self.detok: IncrementalDetokenizer = tokenizer.detokenizer()
        self.stops = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.holdback = 0 if (include_stop or not streaming) else max(self.max_stop - 1, 0)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.keep_text = not streaming or bool(stop)
        self.text = ""  # full text so far (only when keep_text)
        self.sent = 0  # chars of self.text already handed out
        self.parts: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cached_tokens: int | None = None
        self.cache_created = 0  # prompt tokens this request computed and cached (prefill_stats)
        # reasoning split (--reasoning-parser): ids between think=(start, end) are reasoning text
        self.think = think
        self.phase = 0  # 0 before the thinking span, 1 inside it, 2 after it
        self.reasoning: list[str] = []
        self.reasoning_delta = ""
        self.reasoning_tokens = 0
        self.rdetok = tokenizer.detokenizer() if think else None
        self.want_logprobs = want_logprobs
        self.keep_ids = keep_ids or want_logprobs is not None  # token_ids: logprobs or return_token_ids
        self.token_ids: list[int] = []  # emitted ids (only kept when logprobs are wanted)
        self.finished = False
        self.by_frontend = False  # a stop string ended it (the engine request must be aborted)
        self.kv_transfer_params: dict[str, Any] | None = None  # P/D: what the decode side needs

    def process(self, out: EngineCoreOutput) -> tuple[str, list[int]]:
        """Apply one engine output; returns (delta text, delta token ids).

        When a stop string ends the sequence, `finished` is set and the caller must stop
        reading (closing the engine iterator aborts the request in the engine).
        """
        ids = out.new_token_ids
        if out.error is not None:
            self.error = out.error  # the engine says why it refused the request (vLLM 0.33's RequestError)
        ps = out.prefill_stats
        if ps is not None and self.cached_tokens is None:
            self.cached_tokens = ps.num_cached_tokens
            self.cache_created = ps.num_cache_creation_tokens
        fr = out.finish_reason
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if self.think is not None:
            return self._process_with_reasoning(out)
        if self.stops:
            return self._process_with_stops(ids, fr, out.stop_reason)
        self.num_tokens += len(ids)
        if fr is None:
            text = self.detok.add(ids)
        else:
            # EOS / stop token ids end the sequence without their text, as in vLLM
            # (a partial character left at the end is never shown: IncrementalDetokenizer.flush)
            text = self.detok.add(ids[:-1] if (fr is _STOP and ids and not isinstance(out.stop_reason, str)) else ids)
            self.finish_reason = _FINISH_STR[fr]
            self.stop_reason = out.stop_reason
            self.finished = True
        if self.keep_text:
            self.parts.append(text)
        if self.keep_ids:
            self.token_ids.extend(ids)
        return text, ids

    def _process_with_reasoning(self, out: EngineCoreOutput) -> tuple[str, list[int]]:
        """Route each token to the reasoning or the content text by the thinking markers, as a
        reasoning parser does; the markers themselves are not text. (Stop strings are not applied
        in this mode.)"""
        ids = out.new_token_ids
        fr = out.finish_reason
        start, end = self.think
        n = len(ids)
        last_is_stop_tok = fr is _STOP and n > 0 and not isinstance(out.stop_reason, str)
        content: list[str] = []
        reasoning: list[str] = []
        for k, tid in enumerate(ids):
            if tid == start and self.phase == 0:
                self.phase = 1
                continue
            if tid == end and self.phase == 1:
                self.phase = 2
                reasoning.append(self.rdetok.flush())
                continue
            if last_is_stop_tok and k == n - 1:
                continue
            if self.phase == 1:
                self.reasoning_tokens += 1
                reasoning.append(self.rdetok.add([tid]))
            else:
                content.append(self.detok.add([tid]))
        self.num_tokens += n
        if fr is not None:  # (a partial character left at the end is never shown)
            self.finish_reason = _FINISH_STR[fr]
            self.stop_reason = out.stop_reason
            self.finished = True
        text = "".join(content)
        self.reasoning_delta = "".join(reasoning)
        if self.reasoning_delta:
            self.reasoning.append(self.reasoning_delta)
        if self.keep_text:
            self.parts.append(text)
        if self.keep_ids:
            self.token_ids.extend(ids)
        return text, ids

    def _process_with_stops(self, ids: list[int], fr: FinishReason | None, stop_reason: Any) -> tuple[str, list[int]]:
        # Token by token, so the stop string is found at the same token however outputs merged.
        detok = self.detok
        n = len(ids)
        used = 0
        last_is_stop_tok = fr is _STOP and n > 0 and not isinstance(stop_reason, str)
        for k, tid in enumerate(ids):
            used = k + 1
            self.num_tokens += 1
            if last_is_stop_tok and k == n - 1:
                new = ""
            else:
                new = detok.add([tid])
            if not new:
                continue
            self.text += new
            if self.num_tokens <= self.min_tokens:
                continue
            start = max(0, len(self.text) - len(new) - self.max_stop + 1)
            best = -1
            best_s = ""
            for s in self.stops:
                i = self.text.find(s, start)
                if i != -1 and (best == -1 or i < best):
                    best, best_s = i, s
            if best != -1:
                self.text = self.text[: best + (len(best_s) if self.include_stop else 0)]
                self.finish_reason = "stop"
                self.stop_reason = best_s
                self.finished = True
                self.by_frontend = fr is None or used < n
                break
        if not self.finished and fr is not None:  # (a partial character left at the end is never shown)
            self.finish_reason = _FINISH_STR[fr]
            self.stop_reason = stop_reason
            self.finished = True
        if self.finished:
            delta = self.text[self.sent:]
            self.sent = len(self.text)
        else:
            end = max(self.sent, len(self.text) - self.holdback)
            delta = self.text[self.sent:end]
            self.sent = end
        used_ids = ids[:used] if used < n else ids
        if self.keep_ids:
            self.token_ids.extend(used_ids)
        return delta, used_ids

    def full_text(self) -> str:
        return self.text if (self.stops and self.think is None) else "".join(self.parts)


class OutputStream:
    """Outputs from one or many engine streams, in arrival order; `index(out)` says whose.

    With a single request the engine's own iterator is handed out as is (no extra generator
    layer per token). `cancel(i)` stops reading stream i (its engine request is aborted);
    `aclose()` (or leaving the `async with`) closes all of them. Closing an engine iterator
    aborts its request.
    """

    def __init__(self, engine: Any, requests: list[EngineCoreRequest]):
        self._engine = engine
        self._requests = requests
        self._tasks: list[asyncio.Task] = []
        self._gen: Any = None
        self.single = len(requests) == 1
        self._index = {r.request_id: i for i, r in enumerate(requests)}

    def index(self, out: EngineCoreOutput) -> int:
        return 0 if self.single else self._index[out.request_id]

    async def __aenter__(self) -> "OutputStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[EngineCoreOutput]:
        self._gen = self._engine.generate(self._requests[0]) if self.single else self._iter_many()
        return self._gen

    async def _iter_many(self) -> AsyncIterator[EngineCoreOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(req: EngineCoreRequest) -> None:
            try:
                async with aclosing(self._engine.generate(req)) as gen:
                    async for out in gen:
                        queue.put_nowait(out)
            except asyncio.CancelledError:
                pass
            except Exception as e:  # surfaced to the consumer
                queue.put_nowait(e)
            finally:
                queue.put_nowait(done)

        self._tasks = [asyncio.ensure_future(pump(r)) for r in self._requests]
        remaining = len(self._tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self, i: int) -> None:
        if not self.single and i < len(self._tasks) and not self._tasks[i].done():
            self._tasks[i].cancel()

    async def aclose(self) -> None:
        for t in self._tasks:
            if not t.done():
                t.cancel()
        if self._gen is not None:
            await self._gen.aclose()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
