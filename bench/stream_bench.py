#!/usr/bin/env python3
"""Closed-loop streaming benchmark client for OpenAI-compatible servers (asyncio + aiohttp).

C workers send N streaming requests in total (each worker sends its next request as soon as its
previous one ends). Prompts are ISL random vocabulary ids from a tokenizer dir, decoded to text
(chat) or sent as token ids (`--endpoint completions --token-ids`). Every request asks for exactly
OSL tokens: `max_tokens=OSL`, `ignore_eos=true`, `stream_options.include_usage=true`.

usage:
  stream_bench.py --url http://127.0.0.1:8000 --tokenizer DIR --isl 128 --osl 256 \
      --concurrency 64 --requests 512 [--pids 123,456] [--out result.json]

What is measured (all client-side, `time.perf_counter`, one stamp per socket read):
  ttft_ms         send -> first SSE event whose delta carries text
  itl_chunk_ms    pooled gaps between consecutive content events of a request. Events that arrive
                  in the same socket read share one stamp, so server- or TCP-side coalescing
                  shows up as 0 ms gaps (this is what a user of the stream sees)
  itl_token_ms    pooled per-token gaps. A content event that carries k tokens contributes one
                  gap (time since the previous event) and k-1 gaps of 0: all k tokens arrived
                  together. k is exact with `--continuous-usage` (usage.completion_tokens on
                  every chunk, a vLLM extension); otherwise every content event counts as 1
                  token, and itl_token == itl_chunk
  itl_1tok_ms     per-chunk gaps that end in a one-token chunk (with --continuous-usage): pacing
                  without the chunks that carry 2 tokens because the detokenizer held back a
                  partial UTF-8 token (random ids of a byte-level BPE: ~1.5 % of tokens)
  itl_1tok_calm_ms  those of them that ended away from arrivals (no request sent in the 0.5 s
                  before): a closed loop's C streams end together and the next C arrive together,
                  and the server's per-request work then competes with the running streams
  ttft_steady_ms  TTFT of the requests after the first C (without the opening burst)
  tpot_ms         per request: (last content stamp - first content stamp) / (tokens - 1), the
                  decode rate a request sees, insensitive to coalescing; p50/p99 across requests
  output_tok_per_s  sum of usage.completion_tokens (content events if a server sends no usage)
                  over the wall time of the measured phase
  server_cpu_pct, server_cpu_us_per_token  utime+stime of the --pids process trees (children
                  included, re-walked at the end so late-spawned workers count) over the measured
                  phase, from /proc
  server_peak_rss_mb  peak of the summed RSS of those trees, sampled every 0.25 s
  client_cpu_pct  this process's own CPU over the measured phase

Output: JSON (stdout or --out) and a one-line summary on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import re
import resource
import statistics
import sys
import time

import aiohttp

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

# ------------------------------------------------------------------ /proc accounting


def _ppid_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        # the command name may contain spaces and parens: fields start after the last ')'
        ppid = int(raw[raw.rfind(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def process_tree(roots: list[int]) -> set[int]:
    kids, seen, todo = _ppid_map(), set(), list(roots)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(kids.get(p, ()))
    return seen


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, its reaped children's included (0, 0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0, 0.0
    utime, stime, cutime, cstime = (int(x) for x in raw[raw.rfind(b")") + 2 :].split()[11:15])
    return (utime + cutime) / CLK_TCK, (stime + cstime) / CLK_TCK


def cpu_seconds(pids) -> float:
    """utime+stime plus reaped children's cutime+cstime, summed."""
    return sum(sum(cpu_split(p)) for p in pids)


def rss_bytes(pids) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm", "rb") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            continue
    return total


def box_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine (all cores) from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


class TreeCPU:
    """CPU seconds of process trees between start() and stop().

    Per-pid baselines, so a process that appears mid-run only counts from when it is first seen
    (or from 0 if it was born during the run: all its CPU is inside the window)."""

    def __init__(self, roots: list[int]):
        self.roots = roots
        self.base: dict[int, tuple[float, float]] = {}
        self.peak_rss = 0
        self.system = 0.0  # of stop()'s CPU seconds, the kernel's (system time)
        self.by_pid: dict[int, float] = {}  # of stop()'s CPU seconds, each process's

    def start(self) -> None:
        self.base = {p: cpu_split(p) for p in process_tree(self.roots)}

    def sample_rss(self) -> None:
        self.peak_rss = max(self.peak_rss, rss_bytes(process_tree(self.roots)))

    def stop(self) -> tuple[float, list[int]]:
        pids = process_tree(self.roots)
        user = system = 0.0
        for p in pids:
            (u, s), (u0, s0) = cpu_split(p), self.base.get(p, (0.0, 0.0))
            user, system = user + u - u0, system + s - s0
            self.by_pid[p] = u - u0 + s - s0
        # processes that exited during the window: their CPU lands in the parent's cutime/cstime
        self.system = system
        return user + system, sorted(pids)


# ------------------------------------------------------------------ prompts


def make_prompts(tokenizer_dir: str, isl: int, count: int, seed: int, as_ids: bool):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    specials = {tok.token_to_id(t) for t in tok.get_vocab() if t.startswith("<|")}
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = []
        while len(ids) < isl:
            t = rng.randrange(vocab)
            if t not in specials:
                ids.append(t)
        if as_ids:
            out.append(ids)
            continue
        # decode -> re-encode -> trim, so the text re-tokenizes to about ISL tokens
        text = tok.decode(ids)
        again = tok.encode(text, add_special_tokens=False).ids[:isl]
        out.append(tok.decode(again))
    return out


# ------------------------------------------------------------------ SSE scanning
# Parsing every chunk's JSON would make the client the bottleneck at 50k chunks/s on 2 shared
# cores, so events are classified with byte searches; only `usage` numbers are extracted.

_CONTENT_KEYS = (b'"content":', b'"reasoning_content":', b'"text":')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')


def _has_text(event: bytes) -> bool:
    """True if some delta/text field holds a non-empty string."""
    for key in _CONTENT_KEYS:
        i = event.find(key)
        while i >= 0:
            j = i + len(key)
            while j < len(event) and event[j] == 0x20:
                j += 1
            # a string value that is not "" (null / "" are the role-only and final chunks)
            if event[j : j + 1] == b'"' and event[j + 1 : j + 2] != b'"':
                return True
            i = event.find(key, j)
    return False


class Rec:
    __slots__ = ("t0", "t1", "stamps", "ktoks", "usage", "prompt_tokens", "err", "_buf", "_last_usage")

    def __init__(self, t0: float):
        self.t0 = t0
        self.t1 = t0
        self.stamps: list[float] = []  # one per content event
        self.ktoks: list[int] = []  # tokens carried by that event (1 unless continuous usage)
        self.usage: int | None = None
        self.prompt_tokens: int | None = None
        self.err: str | None = None
        self._buf = b""
        self._last_usage = 0

    def feed(self, data: bytes, now: float) -> None:
        """Scan SSE bytes received at `now`; an incomplete trailing event waits for the next read."""
        buf = self._buf + data if self._buf else data
        if b"\n\n" not in buf:
            self._buf = buf
            return
        *events, self._buf = buf.split(b"\n\n")
        for ev in events:
            if not ev.startswith(b"data:"):
                ev = ev.strip()
                if not ev.startswith(b"data:"):
                    continue
            if ev.startswith(b"data: [DONE]") or ev.startswith(b"data:[DONE]"):
                continue
            if b'"error"' in ev and b'"choices"' not in ev:
                self.err = ev[5:205].decode(errors="replace").strip()
                continue
            m = _COMPLETION_TOKENS.search(ev) if b'"usage"' in ev else None
            if _has_text(ev):
                k = 1
                if m is not None:
                    # tokens since the last content event: a chunk whose text the detokenizer
                    # held back (partial UTF-8) hands its tokens on to this one
                    n = int(m.group(1))
                    k = max(1, n - self._last_usage)
                    self._last_usage = n
                self.stamps.append(now)
                self.ktoks.append(k)
            if m is not None:
                self.usage = int(m.group(1))
                pm = _PROMPT_TOKENS.search(ev)
                if pm:
                    self.prompt_tokens = int(pm.group(1))

    def close(self) -> None:
        self.t1 = time.perf_counter()
        self._buf = b""
        if self.err is None and not self.stamps:
            self.err = "no content events"


# ------------------------------------------------------------------ transport 1: aiohttp


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, rec: Rec) -> None:
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                rec.err = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for data in resp.content.iter_any():
                rec.feed(data, time.perf_counter())
    except Exception as e:  # noqa: BLE001 - any transport failure is one counted error
        rec.err = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.close()


# ------------------------------------------------------------------ transport 2: raw HTTP/1.1
# aiohttp's per-event path (StreamReader, async iterator, task wake-up) cost 1.5-2x the client
# CPU of this one in a side-by-side check; at 1000 streams x 50 events/s the client's CPU is
# taken from the same two cores as the server's. This protocol stamps and scans inside
# data_received, with only the chunked framing decoded by hand.


class _RawConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time (a closed-loop worker)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.rec: Rec | None = None
        self.done: asyncio.Future | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head = b""
        self.in_body = False
        self.status = 0
        self.chunked = False
        self.length = -1
        self.raw = b""
        self.errbody = b""

    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport

    def connection_lost(self, exc) -> None:  # noqa: ANN001
        self.closed = True
        self._finish(f"connection lost: {exc}" if exc else "connection closed by server")

    def request(self, payload: bytes, rec: Rec, done: asyncio.Future) -> None:
        self._reset()
        self.rec, self.done = rec, done
        self.transport.write(payload)

    def _finish(self, err: str | None = None) -> None:
        rec, done = self.rec, self.done
        self.rec = self.done = None
        if rec is None:
            return
        if err and rec.err is None:
            rec.err = err
        if done is not None and not done.done():
            done.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        rec = self.rec
        if rec is None:
            return
        if not self.in_body:
            self.head += data
            i = self.head.find(b"\r\n\r\n")
            if i < 0:
                return
            head, data = self.head[:i], self.head[i + 4:]
            self.in_body = True
            lines = head.split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            for ln in lines[1:]:
                k, _, v = ln.partition(b":")
                k = k.strip().lower()
                if k == b"transfer-encoding" and b"chunked" in v.lower():
                    self.chunked = True
                elif k == b"content-length":
                    self.length = int(v.strip())
        if not self.chunked:  # a plain body: only error replies here
            self.errbody += data
            if self.length >= 0 and len(self.errbody) >= self.length:
                self._plain_done()
            return
        raw = self.raw + data if self.raw else data
        pos = 0
        while True:
            j = raw.find(b"\r\n", pos)
            if j < 0:
                break
            size = int(raw[pos:j].split(b";", 1)[0], 16)
            if size == 0:
                if raw.find(b"\r\n", j + 2) < 0:  # the CRLF ending the (empty) trailer section
                    break
                self.raw = b""
                self._chunked_done()
                return
            end = j + 2 + size
            if len(raw) < end + 2:
                break  # the chunk is not complete yet: it is stamped when it is
            payload = raw[j + 2:end]
            if self.status == 200:
                rec.feed(payload, now)
            else:
                self.errbody += payload
            pos = end + 2
        self.raw = raw[pos:] if pos else raw

    def _plain_done(self) -> None:
        if self.status != 200:
            self._finish(f"HTTP {self.status}: {self.errbody[:200].decode(errors='replace')}")
        else:
            self.rec.feed(self.errbody, time.perf_counter())
            self._finish()

    def _chunked_done(self) -> None:
        if self.status != 200:
            self._finish(f"HTTP {self.status}: {self.errbody[:200].decode(errors='replace')}")
        else:
            self._finish()


class RawClient:
    """A pool of keep-alive connections, one per closed-loop worker."""

    def __init__(self, url: str, timeout: float):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.path = u.path or "/"
        self.timeout = timeout
        self.idle: list[_RawConn] = []

    def payload(self, body: bytes) -> bytes:
        return (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def one(self, payload: bytes, rec: Rec) -> None:
        loop = asyncio.get_running_loop()
        conn = None
        try:
            while self.idle:
                c = self.idle.pop()
                if not c.closed:
                    conn = c
                    break
            if conn is None:
                _, conn = await loop.create_connection(_RawConn, self.host, self.port)
            done = loop.create_future()
            conn.request(payload, rec, done)
            await asyncio.wait_for(done, self.timeout)
            if not conn.closed and rec.err is None:
                self.idle.append(conn)
            elif not conn.closed:
                conn.transport.close()
        except Exception as e:  # noqa: BLE001 - any transport failure is one counted error
            if rec.err is None:
                rec.err = f"{type(e).__name__}: {e}"[:200]
            if conn is not None and conn.transport is not None:
                conn.transport.close()
        finally:
            rec.close()

    async def preconnect(self, n: int, batch: int = 50) -> None:
        """Open n keep-alive connections before the measured phase, a batch at a time, so a
        1000-stream run measures streaming and not a connect storm against a busy accept loop."""
        loop = asyncio.get_running_loop()
        while len(self.idle) < n:
            k = min(batch, n - len(self.idle))
            conns = await asyncio.gather(*(loop.create_connection(_RawConn, self.host, self.port)
                                           for _ in range(k)))
            self.idle.extend(c for _, c in conns)

    def close(self) -> None:
        for c in self.idle:
            c.transport.close()
        self.idle.clear()


# ------------------------------------------------------------------ statistics


def percentile(sorted_xs: list[float], p: float) -> float | None:
    if not sorted_xs:
        return None
    k = (len(sorted_xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def summary(xs: list[float]) -> dict[str, float | None]:
    s = sorted(xs)
    out = {f"p{p}": percentile(s, p) for p in (50, 90, 99)}
    out["mean"] = statistics.fmean(s) if s else None
    out["max"] = s[-1] if s else None
    out["n"] = len(s)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


SETTLE_S = 0.5  # a gap is away from arrivals when no request was sent this long before its end


def away_from_sends(sends: list[float], t: float, settle: float = SETTLE_S) -> bool:
    """No request was sent in the `settle` seconds before `t` (`sends` sorted)."""
    i = bisect.bisect_right(sends, t)
    return i == 0 or sends[i - 1] <= t - settle


def analyse(recs: list[Rec], first_wave: int = 0) -> dict:
    ok = [r for r in recs if r.err is None]
    # requests after the first C: TTFT without the closed loop's opening burst of C requests
    later = [r for r in recs[first_wave:] if r.err is None]
    ttft, itl_chunk, itl_token, itl_1tok, itl_calm, tpot = [], [], [], [], [], []
    sends = sorted(r.t0 for r in recs)
    for r in ok:
        st = r.stamps
        ttft.append((st[0] - r.t0) * 1e3)
        for i in range(1, len(st)):
            g = (st[i] - st[i - 1]) * 1e3
            itl_chunk.append(g)
            itl_token.append(g)
            k = r.ktoks[i]
            if k > 1:
                itl_token.extend([0.0] * (k - 1))
            else:
                itl_1tok.append(g)
                if away_from_sends(sends, st[i]):
                    itl_calm.append(g)
        if r.ktoks and r.ktoks[0] > 1:
            itl_token.extend([0.0] * (r.ktoks[0] - 1))
        ntok = r.usage if r.usage is not None else sum(r.ktoks)
        if ntok > 1 and len(st) > 1:
            tpot.append((st[-1] - st[0]) * 1e3 / (ntok - 1))
    # coarse shape of the per-chunk gaps: bins of 5 ms up to 100 ms, then one overflow bin
    bins = [0] * 21
    for g in itl_chunk:
        bins[min(20, int(g // 5))] += 1
    return {
        "ok": len(ok),
        "itl_chunk_hist_5ms": bins,
        "ttft_ms": summary(ttft),
        "ttft_steady_ms": summary([(r.stamps[0] - r.t0) * 1e3 for r in later]),
        "itl_chunk_ms": summary(itl_chunk),
        "itl_token_ms": summary(itl_token),
        # gaps that end in a one-token chunk: the pacing itself, without the chunks that carry
        # two tokens because the detokenizer held back a partial UTF-8 token (needs continuous usage)
        "itl_1tok_ms": summary(itl_1tok),
        "itl_1tok_calm_ms": summary(itl_calm),
        "tpot_ms": summary(tpot),
        "e2e_ms": summary([(r.t1 - r.t0) * 1e3 for r in ok]),
        "content_events": sum(len(r.stamps) for r in ok),
        "output_tokens": sum((r.usage if r.usage is not None else sum(r.ktoks)) for r in ok),
        "usage_missing": sum(1 for r in ok if r.usage is None),
        "prompt_tokens_mean": (
            round(statistics.fmean(p), 1) if (p := [r.prompt_tokens for r in ok if r.prompt_tokens]) else None
        ),
    }


# ------------------------------------------------------------------ driver


async def run(a: argparse.Namespace) -> dict:
    as_ids = a.endpoint == "completions" and a.token_ids
    prompts = make_prompts(a.tokenizer, a.isl, min(a.requests, a.distinct_prompts), a.seed, as_ids)
    path = "/v1/chat/completions" if a.endpoint == "chat" else "/v1/completions"
    url = a.url.rstrip("/") + path
    base: dict = {"model": a.model, "max_tokens": a.osl, "stream": True, "stream_options": {"include_usage": True}}
    if a.continuous_usage:
        base["stream_options"]["continuous_usage_stats"] = True
    if a.ignore_eos:
        base["ignore_eos"] = True
    if a.min_tokens:
        base["min_tokens"] = a.osl
    if a.temperature is not None:
        base["temperature"] = a.temperature

    def body(i: int, max_tokens: int | None = None) -> bytes:
        p = prompts[i % len(prompts)]
        d = dict(base)
        if max_tokens is not None:
            d["max_tokens"] = max_tokens
        if a.endpoint == "chat":
            d["messages"] = [{"role": "user", "content": p}]
        else:
            d["prompt"] = p
        return json.dumps(d).encode()

    bodies = [body(i) for i in range(len(prompts))]  # pre-encoded: no JSON work in the loop
    roots = [int(p) for p in a.pids.split(",") if p.strip()] if a.pids else []
    mon = TreeCPU(roots)
    recs: list[Rec] = []
    if a.transport == "raw":
        raw = RawClient(url, a.timeout)
        payloads = [raw.payload(b) for b in bodies]  # request bytes built once

        async def send(i: int, r: Rec, warm_body: bytes | None = None) -> None:
            await raw.one(raw.payload(warm_body) if warm_body else payloads[i % len(payloads)], r)
        session = None
    else:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, force_close=False)
        session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=a.timeout))

        async def send(i: int, r: Rec, warm_body: bytes | None = None) -> None:
            await one_request(session, url, warm_body or bodies[i % len(bodies)], r)

    try:
        # warm-up: opens connections and lets the server settle; not measured
        if a.warmup:
            warm = [Rec(time.perf_counter()) for _ in range(min(a.warmup, a.concurrency))]
            await asyncio.gather(*(send(i, r, body(i, 4)) for i, r in enumerate(warm)))
            bad = [r.err for r in warm if r.err]
            if len(bad) == len(warm):
                raise SystemExit(f"warm-up failed: {bad[0]}")

        if a.transport == "raw" and a.preconnect:
            await raw.preconnect(a.concurrency)

        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while next_i < a.requests:
                i = next_i
                next_i += 1
                r = Rec(time.perf_counter())
                recs.append(r)
                await send(i, r)

        async def rss_sampler() -> None:
            while True:
                mon.sample_rss()
                await asyncio.sleep(0.25)

        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        box0 = box_cpu_seconds()
        mon.start()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(rss_sampler()) if roots else None
        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
        wall = time.perf_counter() - t0
        server_cpu, pids = mon.stop() if roots else (0.0, [])
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        box1 = box_cpu_seconds()
        if sampler:
            sampler.cancel()
    finally:
        if session is not None:
            await session.close()
        else:
            raw.close()

    res = analyse(recs, first_wave=a.concurrency)
    if a.stamps:  # every request's send time and content-event stamps, for a timeline of the run
        with open(a.stamps, "w") as f:
            for r in recs:
                if r.err is None:
                    f.write(json.dumps({"t0": r.t0, "stamps": r.stamps, "ktoks": r.ktoks}) + "\n")
    errs = [r.err for r in recs if r.err is not None]
    out = {
        "label": a.label,
        "url": url,
        "transport": a.transport,
        "endpoint": a.endpoint,
        "isl": a.isl,
        "osl": a.osl,
        "concurrency": a.concurrency,
        "requests": a.requests,
        "errors": len(errs),
        "error_samples": sorted(set(errs))[:3],
        "wall_s": round(wall, 3),
        "req_per_s": round(res["ok"] / wall, 2),
        "output_tok_per_s": round(res["output_tokens"] / wall, 1),
        "events_per_s": round(res["content_events"] / wall, 1),  # SSE content events, whatever they carry
        **res,
        "client_cpu_pct": round(
            100 * ((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / wall, 1
        ),
    }
    client_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    # everything else on the machine during the run (other users of the shared cores)
    out["box_cpu_pct"] = round(100 * (box1 - box0) / wall, 1)
    out["other_cpu_pct"] = round(100 * max(0.0, (box1 - box0) - client_cpu - server_cpu) / wall, 1)
    out["ncpu"] = os.cpu_count()
    if roots:
        out["server_pids"] = pids
        out["server_cpu_s"] = round(server_cpu, 3)
        out["server_cpu_s_by_pid"] = {str(p): round(c, 3) for p, c in sorted(mon.by_pid.items())}
        out["server_cpu_pct"] = round(100 * server_cpu / wall, 1)
        out["server_cpu_us_per_token"] = round(1e6 * server_cpu / max(1, res["output_tokens"]), 2)
        out["server_cpu_us_per_event"] = round(1e6 * server_cpu / max(1, res["content_events"]), 2)
        # the kernel's part (system time: the socket writes and reads); the rest is the server's own code
        out["server_sys_us_per_event"] = round(1e6 * mon.system / max(1, res["content_events"]), 2)
        out["server_peak_rss_mb"] = round(mon.peak_rss / 2**20, 1)
    return out


def one_line(r: dict) -> str:
    def f(d, k):
        v = d.get(k)
        return "-" if v is None else f"{v:.1f}"

    s = (
        f"[{r.get('label') or r['url']}] c={r['concurrency']} n={r['requests']} "
        f"{r['req_per_s']:.1f} req/s {r['output_tok_per_s']:.0f} tok/s | "
        f"TTFT p50/p99 {f(r['ttft_ms'], 'p50')}/{f(r['ttft_ms'], 'p99')} ms | "
        f"ITL(chunk) p50/p99 {r['itl_chunk_ms']['p50'] or 0:.2f}/{r['itl_chunk_ms']['p99'] or 0:.2f} ms | "
        f"TPOT p50 {r['tpot_ms']['p50'] or 0:.2f} ms | errors {r['errors']} | client CPU {r['client_cpu_pct']}%"
    )
    if "server_cpu_pct" in r:
        s += (
            f" | server CPU {r['server_cpu_pct']}% {r['server_cpu_us_per_token']} us/tok"
            f" RSS {r['server_peak_rss_mb']} MB"
        )
    s += f" | others {r['other_cpu_pct']}%"
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--token-ids", action="store_true", help="completions: send the prompt as token ids (exact ISL)")
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=256)
    p.add_argument("--concurrency", "-c", type=int, default=64)
    p.add_argument("--requests", "-n", type=int, default=512)
    p.add_argument("--warmup", type=int, default=8, help="short requests before the measured phase")
    p.add_argument("--distinct-prompts", type=int, default=512)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request total timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--min-tokens", action="store_true", help="also send min_tokens=OSL")
    p.add_argument("--continuous-usage", action="store_true",
                   help="ask for usage on every chunk (vLLM extension): exact tokens per chunk")
    p.add_argument("--pids", default="", help="comma list of server PIDs; their process trees are measured")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="", help="write the JSON here (else stdout)")
    p.add_argument("--stamps", default="", help="also write each request's send time and event stamps "
                                                 "(JSON lines, perf_counter seconds) here")
    p.add_argument("--no-uvloop", dest="uvloop", action="store_false")
    p.add_argument("--no-preconnect", dest="preconnect", action="store_false",
                   help="raw transport: do not open the C connections before the measured phase")
    p.add_argument("--transport", choices=["raw", "aiohttp"], default="raw",
                   help="raw: a minimal HTTP/1.1 protocol that stamps inside data_received (less client "
                        "CPU per event); aiohttp: the aiohttp client")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    loop_factory = None
    if a.uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        res = runner.run(run(a))
    js = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(js + "\n")
    else:
        print(js)
    print(one_line(res), file=sys.stderr)
    return 0 if res["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
