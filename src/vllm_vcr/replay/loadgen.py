"""The open-loop load generator behind `replay-arrivals`.

Requests are sent at their recorded arrival offsets (divided by `time_scale`) whether or not the
server keeps up — open loop, so queueing shows up as TTFT the way it did in the capture. Turns of
one session (see sessions.py) wait for their previous turn. Each response is streamed and timed
client-side into a new trace record; records are written as requests finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..trace.chunk_timer import ChunkTimer
from ..trace.io import TraceWriter
from .prompts import PromptBuilder, ids_to_text
from ..trace.schema import TraceRecord
from .sessions import find_parents, think_gap_ms
from ..trace.sse import SSEParser

log = logging.getLogger(__name__)


@dataclass
class ReplayConfig:
    target: str
    model: str | None = None
    api: str = "completions"  # or "chat"
    time_scale: float = 1.0
    max_requests: int | None = None
    duration_s: float | None = None  # stop sending after this much (scaled) trace time
    max_in_flight: int = 256
    request_timeout_s: float = 300.0
    sessions: bool = True
    ignore_eos: bool = True
    token_ids: bool = True  # ask vLLM for `return_token_ids` to count multi-token chunks exactly
    max_tokens_cap: int | None = None
    block_size: int = 16
    vocab_size: int = 4000
    seed: int = 0
    api_key: str | None = None


@dataclass
class ReplayResult:
    records: list[TraceRecord] = field(default_factory=list)  # in finish order
    scheduled: int = 0
    sent: int = 0
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    no_tokens: int = 0
    max_lag_ms: float = 0.0
    wall_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)

    def note_error(self, msg: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(msg)


def base_url(target: str) -> str:
    url = target.rstrip("/")
    url = url.removesuffix("/v1")
    if "://" not in url:
        url = "http://" + url
    return url


async def discover_model(session: Any, target: str) -> str | None:
    """The first model the server lists, or None if it does not answer /v1/models."""
    import aiohttp

    try:
        async with session.get(base_url(target) + "/v1/models",
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json()
            models = data.get("data") or []
            return models[0]["id"] if models else None
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
        return None


async def resolve_model(cfg: ReplayConfig, fallback: str | None) -> None:
    """--model, else what the server lists first, else the trace's model."""
    import aiohttp

    if cfg.model is None:
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        async with aiohttp.ClientSession(headers=headers) as session:
            cfg.model = await discover_model(session, cfg.target)
    if cfg.model is None:
        cfg.model = fallback


class Replayer:
    def __init__(self, records: list[TraceRecord], cfg: ReplayConfig,
                 writer: TraceWriter | None = None,
                 on_done: Callable[[int], None] | None = None):
        self.cfg = cfg
        self.records = records[: cfg.max_requests] if cfg.max_requests else records
        self.writer = writer
        self.on_done = on_done or (lambda n=1: None)
        self.prompts = PromptBuilder(cfg.block_size, cfg.vocab_size, cfg.seed)
        self.parents = find_parents(self.records) if cfg.sessions else [None] * len(self.records)
        self.result = ReplayResult()
        self._in_flight = 0
        self._finished_at: dict[int, float] = {}
        self._done_events: dict[int, asyncio.Event] = {
            p: asyncio.Event() for p in self.parents if p is not None
        }

    def _body(self, i: int, rec: TraceRecord, ids: list[int]) -> dict[str, Any]:
        max_tokens = max(rec.output_tokens, 1)
        if self.cfg.max_tokens_cap:
            max_tokens = min(max_tokens, self.cfg.max_tokens_cap)
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.cfg.api == "chat":
            body["messages"] = [{"role": "user", "content": ids_to_text(ids)}]
        else:
            body["prompt"] = ids
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True  # vLLM extension: reproduce the recorded output length
        if self.cfg.token_ids:
            body["return_token_ids"] = True
        return body

    async def run(self) -> ReplayResult:
        import aiohttp

        cfg = self.cfg
        res = self.result
        connector = aiohttp.TCPConnector(limit=max(cfg.max_in_flight, 1))
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            sem = asyncio.Semaphore(max(cfg.max_in_flight, 1))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            self._t0 = t0
            base = self.records[0].arrival_ms if self.records else 0.0
            tasks: set[asyncio.Task[None]] = set()  # only the unfinished ones are kept
            for i, rec in enumerate(self.records):
                offset = ((rec.arrival_ms or 0.0) - (base or 0.0)) / 1e3 / cfg.time_scale
                if cfg.duration_s is not None and offset > cfg.duration_s:
                    break
                delay = t0 + offset - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                res.scheduled += 1
                task = asyncio.create_task(self._one(session, sem, i, rec, t0 + offset))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
            res.wall_s = loop.time() - t0
        return res

    async def _one(self, session: Any, sem: asyncio.Semaphore, i: int, rec: TraceRecord,
                   due: float) -> None:
        loop = asyncio.get_running_loop()
        parent = self.parents[i]
        try:
            if parent is not None:
                await self._done_events[parent].wait()
                after = self._finished_at[parent] + think_gap_ms(
                    self.records[parent], rec) / 1e3 / self.cfg.time_scale
                if after > due:
                    due = after
                    await asyncio.sleep(max(due - loop.time(), 0.0))
            async with sem:
                await self._send(session, i, rec, due)
        except Exception as e:  # noqa: BLE001 - counted and shown, never lost with its task
            self.result.note_error(f"replay-{i}: {type(e).__name__}: {e}")
        finally:
            self._finished_at[i] = loop.time()
            ev = self._done_events.get(i)
            if ev is not None:
                ev.set()
            self.on_done(1)

    async def _send(self, session: Any, i: int, rec: TraceRecord, due: float) -> None:
        import aiohttp

        cfg, res = self.cfg, self.result
        ids, hashes = self.prompts.build(i, rec)
        body = msgspec.json.encode(self._body(i, rec, ids))
        path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
        loop = asyncio.get_running_loop()
        res.max_lag_ms = max(res.max_lag_ms, (loop.time() - due) * 1e3)
        self._in_flight += 1
        concurrency = self._in_flight
        arrival_ms = (loop.time() - self._t0) * 1e3
        t_send = time.perf_counter()
        timer = ChunkTimer(t_send)
        res.sent += 1
        try:
            async with session.post(base_url(cfg.target) + path, data=body,
                                    headers={"X-Request-Id": f"replay-{i}",
                                             "Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s)
                                    ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    res.note_error(f"replay-{i}: HTTP {resp.status}: {text}")
                    return
                parser = SSEParser()
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    if self._feed(timer, parser.feed(data), now, i):
                        return
                self._feed(timer, parser.close(), time.perf_counter(), i)
        except TimeoutError:
            res.timeouts += 1
            return
        except aiohttp.ClientError as e:
            res.note_error(f"replay-{i}: {type(e).__name__}: {e}")
            return
        finally:
            self._in_flight -= 1
        out = timer.to_record(
            prompt_tokens=len(ids), arrival_ms=round(arrival_ms, 3), concurrency=concurrency,
            block_hashes=hashes if cfg.api != "chat" else None,
        )
        if out is None:
            res.no_tokens += 1
            return
        res.ok += 1
        res.records.append(out)
        if self.writer is not None:
            self.writer.write(out)

    def _feed(self, timer: ChunkTimer, events: list[bytes], now: float, i: int) -> bool:
        """Apply stream events; True when the stream reported an error."""
        error = timer.on_events(events, now)
        if error is not None:
            self.result.note_error(f"replay-{i}: stream error: {error}")
        return error is not None
