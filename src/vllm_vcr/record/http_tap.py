"""`record --http`: a recording reverse proxy in front of any OpenAI-compatible server.

Every request is forwarded to the upstream unchanged and every response byte is passed back
unchanged, as it arrives (the proxy forwards first and observes after). Streamed completions
(`/v1/completions`, `/v1/chat/completions` answered with `text/event-stream`) are timed at the
proxy into trace records: TTFT from the request's arrival, one gap per token-bearing SSE chunk.
This is the client's view — there is no engine-step context (`itl_ctx`) — and, like the engine
tap, requests the client abandons or that fail are left out of the trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..trace.block_hash import prompt_block_hashes
from ..trace.chunk_timer import ChunkTimer
from ..trace.io import TraceWriter
from ..trace.schema import SOURCE_HTTP_TAP, TraceMeta
from ..trace.sse import SSEParser

log = logging.getLogger(__name__)

# Connection-level headers are for one hop only (RFC 9110 §7.6.1); the rest pass through.
_HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
))
_TIMED_SUFFIXES = ("/completions",)  # /v1/completions and /v1/chat/completions


@dataclass
class TapStats:
    recorded: int = 0
    unstreamed: int = 0  # completions answered without SSE: nothing to time per chunk
    failed: int = 0  # upstream error status or stream error
    aborted: int = 0  # client went away mid-stream
    prompt_estimated: int = 0
    forwarded: int = 0


@dataclass
class TapConfig:
    upstream: str
    trace_out: str
    model: str | None = None
    gpu: str | None = None
    tp: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16
    tokenizer: str | None = None  # tokenizer.json for text prompts without usage
    timeout_s: float = 3600.0
    extra_meta: dict[str, Any] = field(default_factory=dict)


class _PromptCounter:
    """Prompt length when the response carries no usage: token ids if the client sent ids, a
    tokenizer if given (text without chat template), else ~4 characters per token."""

    def __init__(self, tokenizer_path: str | None):
        self._tok = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(tokenizer_path)

    def count(self, body: dict[str, Any]) -> tuple[int, list[int] | None, bool]:
        """(prompt tokens, token ids if known, estimated?)"""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt), prompt, False
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            return len(prompt[0]), prompt[0], False
        if isinstance(prompt, list):
            text = "".join(p for p in prompt if isinstance(p, str))
        elif isinstance(prompt, str):
            text = prompt
        else:
            parts = []
            for m in body.get("messages") or ():
                c = m.get("content") if isinstance(m, dict) else None
                if isinstance(c, str):
                    parts.append(c)
                elif isinstance(c, list):
                    parts.extend(str(p.get("text", "")) for p in c if isinstance(p, dict))
            text = "\n".join(parts)
        if self._tok is not None:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            return len(ids), ids, True
        return max(len(text) // 4, 1), None, True


class HttpTap:
    def __init__(self, cfg: TapConfig):
        self.cfg = cfg
        self.stats = TapStats()
        self.writer = TraceWriter(cfg.trace_out)
        self._t0: float | None = None  # capture start = first timed request's arrival
        self._in_flight = 0
        self._prompts = _PromptCounter(cfg.tokenizer)
        self._session: Any = None
        self._upstream = cfg.upstream.rstrip("/")

    # -- lifecycle ------------------------------------------------------------------------------

    async def start_session(self) -> None:
        import aiohttp

        # auto_decompress off: compressed bodies go through byte for byte; no connection cap
        # (aiohttp's default of 100 would queue streams inside the proxy and skew their TTFT)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._ensure_meta(None)
        self.writer.close()

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    def _ensure_meta(self, model: str | None) -> None:
        if self.writer.meta_written:
            return
        extra = {"upstream": self.cfg.upstream, **self.cfg.extra_meta}
        self.writer.write_meta(TraceMeta(
            model=self.cfg.model or model, gpu=self.cfg.gpu, tp=self.cfg.tp,
            max_num_seqs=self.cfg.max_num_seqs, source=SOURCE_HTTP_TAP,
            block_size=self.cfg.block_size, extra=extra,
        ))

    # -- the proxy ------------------------------------------------------------------------------

    async def handle(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        t_arrival = time.perf_counter()
        body = await request.read()
        timed_body = self._timed_body(request, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        url = self._upstream + request.rel_url.path_qs
        self.stats.forwarded += 1
        concurrency = 0
        if timed_body is not None:
            if self._t0 is None:
                self._t0 = t_arrival
            self._in_flight += 1
            concurrency = self._in_flight
        try:
            try:
                upstream = await self._session.request(request.method, url, headers=headers,
                                                       data=body, allow_redirects=False)
            except (TimeoutError, aiohttp.ClientError) as e:
                if timed_body is not None:
                    self.stats.failed += 1
                return web.json_response(
                    {"error": {"message": f"upstream unreachable: {e}", "type": "BadGateway",
                               "code": 502}}, status=502)
            async with upstream:
                return await self._relay(request, upstream, timed_body, t_arrival, concurrency)
        finally:
            if timed_body is not None:
                self._in_flight -= 1

    def _timed_body(self, request: Any, body: bytes) -> dict[str, Any] | None:
        if request.method != "POST" or not request.path.rstrip("/").endswith(_TIMED_SUFFIXES):
            return None
        try:
            import json

            obj = json.loads(body)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    async def _relay(self, request: Any, upstream: Any, timed_body: dict[str, Any] | None,
                     t_arrival: float, concurrency: int) -> Any:
        from aiohttp import web

        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                resp.headers.add(k, v)
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length
        ctype = upstream.headers.get("Content-Type", "")
        timing = (timed_body is not None and upstream.status == 200
                  and ctype.startswith("text/event-stream"))
        if timed_body is not None and not timing:
            if upstream.status == 200:
                self.stats.unstreamed += 1
            else:
                self.stats.failed += 1
        timer = ChunkTimer(t_arrival) if timing else None
        parser = SSEParser() if timing else None
        errored = False
        try:
            await resp.prepare(request)
            async for data in upstream.content.iter_any():
                now = time.perf_counter()
                await resp.write(data)  # forward first, observe after
                if timer is not None and not errored:
                    errored = timer.on_events(parser.feed(data), now) is not None
            if timer is not None and not errored:
                errored = timer.on_events(parser.close(), time.perf_counter()) is not None
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            if timer is not None:
                self.stats.aborted += 1
            raise
        if timer is not None:
            if errored:
                self.stats.failed += 1
            else:
                self._record(timer, timed_body, t_arrival, concurrency)
        return resp

    def _record(self, timer: ChunkTimer, body: dict[str, Any], t_arrival: float,
                concurrency: int) -> None:
        if timer.finish_reason is None:
            self.stats.aborted += 1  # stream ended without finishing: treat like an abort
            return
        n_prompt, ids, estimated = self._prompts.count(body)
        has_usage = isinstance((timer.usage or {}).get("prompt_tokens"), int)
        rec = timer.to_record(
            prompt_tokens=n_prompt, arrival_ms=round((t_arrival - (self._t0 or t_arrival)) * 1e3, 3),
            concurrency=concurrency,
            block_hashes=prompt_block_hashes(ids, self.cfg.block_size) if ids and not estimated
            else None,
        )
        if rec is None:
            self.stats.failed += 1
            return
        if estimated and not has_usage:
            self.stats.prompt_estimated += 1
            rec.extra = {"prompt_tokens_estimated": True}
        self._ensure_meta(body.get("model") if isinstance(body.get("model"), str) else None)
        self.writer.write(rec)
        self.stats.recorded += 1


async def serve_tap(cfg: TapConfig, host: str, port: int, stop: asyncio.Event,
                    ready: Any = None) -> TapStats:
    """Run the proxy until `stop` is set; the trace is finalized (gzip trailer) on the way out."""
    from aiohttp import web

    tap = HttpTap(cfg)
    await tap.start_session()
    runner = web.AppRunner(tap.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("recording %s -> %s into %s", f"http://{host}:{port}", cfg.upstream, cfg.trace_out)
        if ready is not None:
            ready(runner.addresses)
        await stop.wait()
    finally:
        await runner.cleanup()
        await tap.close()
    return tap.stats
