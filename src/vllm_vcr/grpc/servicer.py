"""The `VllmEngine` service (smg-grpc-proto's vllm_engine.proto) over the serve process's engine.

Answered as smg-grpc-servicer's `VllmEngineServicer` answers them in `vllm serve --grpc`:
Generate takes token ids (or text, tokenized here) and the proto's SamplingParams (proto3 zeros
mean vLLM's defaults: top_p 0 is 1.0, repetition_penalty 0 is 1.0, n 0 is 1), streams one chunk
per engine output with the delta token ids and, per choice, a `complete` when it finishes (the
last delta again, as DELTA output does); non-streaming sends one `complete` per choice with every
token. A request aborted by `Abort` ends its stream with finish_reason "abort", as vLLM's final
abort output does; a client that cancels the call aborts the engine request. Bad input is
INVALID_ARGUMENT with the frontend's own message (the same checks as the HTTP routes), an engine
failure INTERNAL, an unknown thing NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from ..engine.types import EngineCoreRequest, FinishReason, SamplingParams
from ..frontend.chat_outputs import plan_constraint_output
from ..frontend.errors import HTTPError
from ..frontend.generation import OutputStream, SequenceState, build_engine_request, random_hex
from ..frontend.protocol import RequestValueError
from ..frontend.request_checks import check_prompt_tokens, check_sampling
from ..frontend.structured.constraints import request_constraint
from ..http.serving_base import VLLM_API_VERSION

logger = logging.getLogger("vllm_vcr.grpc")

TOKENIZER_CHUNK = 64 * 1024  # bytes per GetTokenizerChunk, as the servicer streams the bundle
# the files of a tokenizer bundle, as smg-grpc-servicer zips them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
                   "chat_template.json", "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja", "*.model")
KV_EVENTS_OFF = ("KV cache events not enabled. Start vLLM with --kv-events-config "
                 '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'')
_PROFILE_LAUNCH_OPTIONS = ("output_dir", "start_step", "num_steps", "with_stack", "record_shapes")


def status_for(exc: BaseException) -> grpc.StatusCode:
    """vLLM's split: a client's bad request is INVALID_ARGUMENT, a missing thing NOT_FOUND, an
    overloaded engine UNAVAILABLE, anything else INTERNAL."""
    if isinstance(exc, HTTPError):
        return {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}.get(
                    exc.status, grpc.StatusCode.INTERNAL)
    if isinstance(exc, ValueError):  # RequestValueError included
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def sampling_fields(p: Any) -> SimpleNamespace:
    """The proto's SamplingParams as the fields build_engine_request and check_sampling read, with
    the servicer's defaults for proto3's zero values."""
    return SimpleNamespace(
        n=p.n if p.n > 0 else 1,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.top_p != 0.0 else 1.0, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=dict(p.logit_bias) if p.logit_bias else None, allowed_token_ids=None,
        vllm_xargs=None, kv_transfer_params=None, cache_salt=None, priority=0, use_beam_search=False)


def structured_outputs(p: Any) -> dict[str, Any] | None:
    """The proto's `constraint` oneof as vLLM's StructuredOutputsParams fields."""
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return {"json": p.json_schema}
    if kind == "choice":
        return {"choice": list(p.choice.choices)}
    return {kind: getattr(p, kind)}


class _Aborted(Exception):
    """The request was aborted by an Abort call while its Generate stream was open."""


async def _until(source: Any, aborted: asyncio.Event) -> AsyncIterator[Any]:
    """The outputs of `source` until `aborted` is set (then _Aborted)."""
    it = source.__aiter__()
    waiter = asyncio.ensure_future(aborted.wait())
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait((nxt, waiter), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise _Aborted
            try:
                out = nxt.result()
            except StopAsyncIteration:
                return
            yield out
    finally:
        waiter.cancel()
        # an abort, or the caller cancelled (the client went away) while an output was awaited: the
        # pending read ends first, so that closing the source afterwards aborts the engine request
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt


class VllmEngineService(vllm_engine_pb2_grpc.VllmEngineServicer):
    """One per `serve --grpc` process: the engine, the tokenizer and what GetModelInfo reports."""

    def __init__(self, engine: Any, tokenizer: Any, settings: Any, *, model_path: str, max_num_seqs: int,
                 kv_endpoints: list[tuple[int, str]] | None = None, kv_topic: str = "",
                 pooling: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_path = model_path
        self.max_num_seqs = max_num_seqs
        self.kv_endpoints = kv_endpoints
        self.kv_topic = kv_topic
        self.pooling = pooling
        self.start_time = time.time()
        self.last_receive = 0.0
        self.vocab_limit = settings.vocab_limit or tokenizer.vocab_size
        self._live: dict[str, asyncio.Event] = {}
        self._bundle: tuple[bytes, str] | None = None
        self._profiling = False

    # -- Generate ---------------------------------------------------------------------------------
    def _prepare(self, request: Any) -> tuple[list[int], list[EngineCoreRequest], list[SequenceState]]:
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            ids = list(request.tokenized.input_ids)
        elif kind == "text":
            ids = self.tokenizer.encode(request.text)
        else:
            raise RequestValueError("GenerateRequest requires tokenized or text input")
        if request.HasField("mm_inputs") or request.HasField("media_refs"):
            raise RequestValueError("multimodal inputs are not supported by this model")
        if not ids:
            raise RequestValueError("The decoder prompt cannot be empty")
        if ids and max(ids) >= self.vocab_limit:
            raise RequestValueError(f"Token id {max(ids)} is out of vocabulary")
        p = request.sampling_params
        s = sampling_fields(p)
        max_len = self.settings.max_model_len
        if p.HasField("truncate_prompt_tokens") and p.truncate_prompt_tokens > 0:
            ids = ids[-p.truncate_prompt_tokens:]
        check_prompt_tokens(len(ids), max_len, from_text=False)
        room = max_len - len(ids)
        limit = min(p.max_tokens, room) if p.HasField("max_tokens") else room
        check_sampling(s, limit)
        constraint = request_constraint(None, structured_outputs(p))
        if request.HasField("kv_transfer_params_json") and request.kv_transfer_params_json:
            import json

            try:
                s.kv_transfer_params = json.loads(request.kv_transfer_params_json)
            except ValueError as e:
                raise RequestValueError(f"kv_transfer_params_json is not JSON: {e}") from None
        logprobs = p.logprobs if p.HasField("logprobs") else None
        seed = p.seed if p.HasField("seed") else None
        dp_rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        if dp_rank is not None and not 0 <= dp_rank < self.settings.engine_count:
            raise RequestValueError(f"data_parallel_rank {dp_rank} is out of range "
                                    f"[0, {self.settings.engine_count}).")
        rid = request.request_id or random_hex()
        states, reqs = [], []
        for j in range(s.n):
            states.append(SequenceState(self.tokenizer, stop=s.stop, include_stop=s.include_stop_str_in_output,
                                        min_tokens=s.min_tokens, streaming=request.stream,
                                        want_logprobs=logprobs, keep_ids=True))
            reqs.append(build_engine_request(
                internal_id=f"{rid}-{j}-{random_hex(8)}" if s.n > 1 else rid, external_id=rid, prompt_ids=ids,
                req=s, max_tokens=limit, seed=None if seed is None else seed + j, logprobs=logprobs,
                stream=request.stream, tokenizer=self.tokenizer, dp_rank=dp_rank))
            if constraint is not None:
                plan_constraint_output(reqs[-1], constraint, None if seed is None else seed + j, self.tokenizer)
        return ids, reqs, states

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.last_receive = time.time()
        rid = request.request_id
        try:
            prompt, reqs, states = self._prepare(request)
        except (HTTPError, ValueError) as e:
            logger.warning("Generate request %s rejected: %s", rid, e)
            await context.abort(status_for(e), str(getattr(e, "message", e)))
            return
        aborted = asyncio.Event()
        self._live[rid] = aborted
        n_prompt = len(prompt)
        try:
            async with OutputStream(self.engine, reqs) as stream:
                try:
                    async for out in _until(stream, aborted):
                        i = stream.index(out)
                        st = states[i]
                        if st.finished:
                            continue
                        if out.finish_reason is FinishReason.ERROR or out.error is not None:
                            raise RuntimeError(str(out.error or "the engine failed the request"))
                        _, ids = st.process(out)
                        if st.finished and st.by_frontend:
                            stream.cancel(i)
                        if request.stream:
                            yield _chunk(ids, st, n_prompt, i)
                            if st.finished:
                                yield _complete(ids, st, n_prompt, i)
                        elif st.finished:
                            yield _complete(st.token_ids, st, n_prompt, i)
                        if all(x.finished for x in states):
                            break
                except _Aborted:
                    for i, st in enumerate(states):
                        if st.finished:
                            continue
                        st.finish_reason = "abort"
                        if request.stream:
                            yield _chunk([], st, n_prompt, i)
                        yield _complete([] if request.stream else st.token_ids, st, n_prompt, i)
        except Exception as e:  # the engine's failure: INTERNAL, in its words
            logger.exception("Error in Generate for request %s", rid)
            await context.abort(status_for(e), str(e))
        finally:
            if self._live.get(rid) is aborted:
                del self._live[rid]

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        logger.info("Abort requests: %s", list(request.request_ids))
        for rid in request.request_ids:
            event = self._live.get(rid)
            if event is not None:
                event.set()
        return vllm_engine_pb2.AbortResponse()

    # -- Embed ------------------------------------------------------------------------------------
    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.last_receive = time.time()
        try:
            if not request.HasField("tokenized"):
                raise RequestValueError("EmbedRequest requires tokenized input")
            if self.pooling is None or not self.pooling.enabled:
                raise RequestValueError("The model does not support the embed task; start the server with "
                                        "--runner pooling")
            ids = list(request.tokenized.input_ids)
            if not ids:
                raise RequestValueError("The decoder prompt cannot be empty")
            if max(ids) >= self.vocab_limit:
                raise RequestValueError(f"Token id {max(ids)} is out of vocabulary")
            check_prompt_tokens(len(ids), self.settings.max_model_len, from_text=False)
        except (HTTPError, ValueError) as e:
            await context.abort(status_for(e), str(getattr(e, "message", e)))
            return None
        from ..openai.pooling import embed_tokens

        req = EngineCoreRequest(
            request_id=request.request_id or random_hex(), prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True, output_kind=2),
            pooling_params={"task": "embed"}, arrival_time=time.time(), external_req_id=request.request_id)
        finished = False
        async for out in self.engine.generate(req):
            if out.finish_reason is not None:
                finished = out.finish_reason is not FinishReason.ERROR
        if not finished:
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"Embed request {request.request_id} did not produce a result")
            return None
        vec = embed_tokens(ids, self.pooling.embedding_size).tolist()
        return vllm_engine_pb2.EmbedResponse(embedding=vec, prompt_tokens=len(ids), embedding_dim=len(vec))

    # -- health, info, loads ----------------------------------------------------------------------
    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        healthy = self.engine.is_running
        return vllm_engine_pb2.HealthCheckResponse(healthy=healthy,
                                                   message="Health" if healthy else "Engine is not alive")

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tok = self.tokenizer
        eos = tok.eos_token_id
        s = self.settings
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=self.model_path, is_generation=not (self.pooling is not None and self.pooling.enabled),
            max_context_length=s.max_model_len, vocab_size=tok.vocab_size, supports_vision=False,
            served_model_name=s.served_model_names[0], tokenizer_path=self._tokenizer_dir_name(),
            eos_token_ids=[] if eos is None else [eos],
            pad_token_id=_int_or(getattr(tok, "pad_token_id", None)),
            bos_token_id=_int_or(getattr(tok, "bos_token_id", None)), max_req_input_len=s.max_model_len,
            default_sampling_params_json="{}")

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(self._live), is_paused=False, last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.start_time, server_type="vllm-grpc",
            data_parallel_size=self.settings.engine_count, kv_cache_dtype="auto", block_size=self.settings.block_size,
            model_dtype="torch.bfloat16", max_num_seqs=self.max_num_seqs)

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        loads = [vllm_engine_pb2.SchedulerLoad(**fields) for fields in await self.load_fields()]
        return vllm_engine_pb2.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(),
                                                version=VLLM_API_VERSION, dp_rank_count=len(loads), loads=loads)

    async def load_fields(self) -> list[dict[str, Any]]:
        """One SchedulerLoad's fields per engine (DP rank), from the scheduler as it is now."""
        out = []
        for rank, load in enumerate(await self.engine.loads()):
            running, waiting, usage, capacity = load["running"], load["waiting"], load["token_usage"], load["token_capacity"]
            out.append({"dp_rank": rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
                        "num_total_reqs": running + waiting, "token_usage": usage, "utilization": usage,
                        "max_total_num_tokens": capacity, "num_used_tokens": int(round(usage * capacity)),
                        "max_running_requests": self.max_num_seqs})
        return out

    # -- tokenizer --------------------------------------------------------------------------------
    def _tokenizer_dir(self) -> Path:
        source = self.tokenizer.source
        if source == "embedded":
            from importlib import resources

            return Path(str(resources.files("vllm_vcr") / "data"))
        return Path(source)

    def _tokenizer_dir_name(self) -> str:
        return self.tokenizer.source if self.tokenizer.source != "embedded" else self.model_path

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if self._bundle is None:
            try:
                self._bundle = await asyncio.to_thread(tokenizer_bundle, self._tokenizer_dir())
            except Exception as e:
                logger.exception("Failed to build tokenizer ZIP")
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
                return
        data, digest = self._bundle
        for offset in range(0, len(data), TOKENIZER_CHUNK):
            last = offset + TOKENIZER_CHUNK >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[offset:offset + TOKENIZER_CHUNK], sha256=digest if last else "")

    # -- KV events --------------------------------------------------------------------------------
    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if not self.kv_endpoints:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, KV_EVENTS_OFF)
            return
        from .kv_relay import relay

        async for batch in relay(self.kv_endpoints, self.kv_topic, request.start_sequence_number):
            yield batch

    # -- admin ------------------------------------------------------------------------------------
    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        timeout_s = request.timeout_s
        if not (timeout_s == timeout_s and 0 <= timeout_s < float("inf")):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("timeout_s must be finite and non-negative")
            return common_pb2.FlushCacheResponse(success=False, message="Invalid timeout_s")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            results = await self.engine.call_all(lambda core: core.reset_prefix_cache())
            if all(r is not False for r in results):
                return common_pb2.FlushCacheResponse(success=True,
                                                     message="Local KV prefix cache flushed successfully")
            if timeout_s == 0:
                return common_pb2.FlushCacheResponse(
                    success=False, message="KV prefix cache reset refused; requests may be in flight")
            if loop.time() >= deadline:
                message = "Flush cache timed out; the engine may still complete an issued reset"
                context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                context.set_details(message)
                return common_pb2.FlushCacheResponse(success=False, message=message)
            await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))

    async def StartProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        named = [name for name in _PROFILE_LAUNCH_OPTIONS if request.HasField(name)]
        if request.activities:
            named.append("activities")
        if request.profile_by_stage:
            named.append("profile_by_stage")
        if named:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"StartProfile options {', '.join(named)} cannot be set per request on this engine: its "
                "profiler's directory and options are its launch configuration; send a start with no options")
            return None
        if self._profiling:  # vLLM's ProfilerAlreadyActiveError, which the servicer reports as a failed start
            await context.abort(grpc.StatusCode.INTERNAL, "Start profiling failed: A profiling session is already "
                                "active. Call /stop_profile before starting another session.")
            return None
        self._profiling = True  # no torch profiler here: the session is tracked, nothing is recorded
        return common_pb2.ProfileResponse(success=True, message="Start profiling succeeded")

    async def StopProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._profiling = False
        return common_pb2.ProfileResponse(success=True, message="Stop profiling succeeded")


def _int_or(value: Any, default: int = 0) -> int:
    return int(value) if isinstance(value, int) else default


def _finish(st: SequenceState) -> dict[str, Any]:
    kw: dict[str, Any] = {"finish_reason": st.finish_reason or "stop"}
    if isinstance(st.stop_reason, bool) or st.stop_reason is None:
        return kw
    if isinstance(st.stop_reason, int):
        kw["matched_token_id"] = st.stop_reason
    else:
        kw["matched_stop_str"] = str(st.stop_reason)
    return kw


def _chunk(ids: list[int], st: SequenceState, n_prompt: int, index: int) -> Any:
    return vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=n_prompt, completion_tokens=len(ids), cached_tokens=st.cached_tokens or 0,
        index=index))


def _complete(ids: list[int], st: SequenceState, n_prompt: int, index: int) -> Any:
    import json

    kv = {} if st.kv_transfer_params is None else {"kv_transfer_params_json": json.dumps(st.kv_transfer_params)}
    return vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
        output_ids=ids, prompt_tokens=n_prompt, completion_tokens=len(ids), cached_tokens=st.cached_tokens or 0,
        index=index, **_finish(st), **kv))


def tokenizer_bundle(directory: Path) -> tuple[bytes, str]:
    """The tokenizer files of `directory` as one ZIP and its SHA-256, as the servicer bundles them."""
    buf = io.BytesIO()
    added: set[str] = set()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                zf.write(directory / name, name)
                added.add(name)
        for pattern in TOKENIZER_GLOBS:
            for match in sorted(directory.glob(pattern)):
                if match.is_file() and match.name not in added:
                    zf.write(match, match.name)
                    added.add(match.name)
    if not added:
        raise FileNotFoundError(f"No tokenizer files found in {directory}")
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
