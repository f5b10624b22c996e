"""`inspect perfetto`: a trace as Chrome Trace Event JSON (opens in ui.perfetto.dev / chrome://tracing).

Process 1 "inference trace": each request is a `prefill` span (arrival -> first token) followed by
one `decode` span per gap (`decode xN` when a chunk carried N tokens), packed into reusable lanes
(lane count = peak concurrency), plus counters: `active_requests`, `waiting_requests` (arrived,
no token yet), and from `itl_ctx` `engine_running` and `prefill_tokens`. With a step-stats
sidecar, process 2 "scheduler steps" holds one span per scheduler report and counters
`sched_running_reqs`, `sched_waiting_reqs`, `sched_kv_cache_usage`, `sched_accept_rate`.
Times are in microseconds. Records without `arrival_ms` cannot be placed and are dropped.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..trace.io import iter_lines
from ..trace.schema import TraceRecord, replay_subset

log = logging.getLogger(__name__)

PID_TRACE = 1
PID_STEPS = 2
_COLOR_PREFILL = "rail_animation"
_COLOR_DECODE = "thread_state_running"
_COLOR_MIXED = "rail_load"


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


def _counter(name: str, ts_ms: float, value: float, pid: int = PID_TRACE) -> dict[str, Any]:
    return {"name": name, "ph": "C", "ts": _us(ts_ms), "pid": pid, "args": {"value": value}}


def _meta_event(kind: str, pid: int, name: str, tid: int | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _assign_lanes(spans: list[tuple[float, float]]) -> list[int]:
    """Greedy interval packing in arrival order: reuse the lane that freed up first."""
    free: list[tuple[float, int]] = []  # (end, lane)
    lanes: list[int] = []
    n_lanes = 0
    for start, end in spans:
        if free and free[0][0] <= start:
            _, lane = heapq.heappop(free)
        else:
            lane = n_lanes
            n_lanes += 1
        lanes.append(lane)
        heapq.heappush(free, (end, lane))
    return lanes


def _request_events(i: int, rec: TraceRecord, tid: int) -> list[dict[str, Any]]:
    t0 = rec.arrival_ms or 0.0
    first = t0 + rec.ttft_ms
    args = {"request": f"replay-{i}", "prompt_tokens": rec.prompt_tokens,
            "cached_tokens": rec.cached_tokens, "output_tokens": rec.output_tokens,
            "concurrency": rec.concurrency, "ttft_ms": rec.ttft_ms}
    if rec.finish_reason:
        args["finish_reason"] = rec.finish_reason
    evs = [{"name": "prefill", "cat": "request", "ph": "X", "ts": _us(t0), "dur": _us(rec.ttft_ms),
            "pid": PID_TRACE, "tid": tid, "cname": _COLOR_PREFILL, "args": args}]
    t = first
    if rec.itl_ms is not None:
        ctx = rec.itl_ctx
        for j, (gap, n) in enumerate(zip(rec.itl_ms, rec.gap_tokens())):
            mixed = ctx is not None and ctx.prefill_tokens[j] > 0
            ev_args: dict[str, Any] = {"request": f"replay-{i}", "gap_ms": gap, "tokens": n}
            if ctx is not None:
                ev_args["num_running"] = ctx.num_running[j]
                ev_args["prefill_tokens"] = ctx.prefill_tokens[j]
            evs.append({"name": "decode" if n == 1 else f"decode x{n}", "cat": "request", "ph": "X",
                        "ts": _us(t), "dur": _us(gap), "pid": PID_TRACE, "tid": tid,
                        "cname": _COLOR_MIXED if mixed else _COLOR_DECODE, "args": ev_args})
            t += gap
    elif rec.itl_summary is not None and rec.itl_summary.count > 0:
        dur = rec.itl_summary.mean_ms * rec.itl_summary.count
        evs.append({"name": f"decode (mean {rec.itl_summary.mean_ms:.2f} ms)", "cat": "request",
                    "ph": "X", "ts": _us(t), "dur": _us(dur), "pid": PID_TRACE, "tid": tid,
                    "cname": _COLOR_DECODE, "args": {"request": f"replay-{i}",
                                                     "tokens": rec.itl_summary.count}})
    return evs


def _step_counters(recs: list[TraceRecord]) -> list[dict[str, Any]]:
    """Edge-triggered counters of requests in flight / awaiting their first token."""
    deltas: list[tuple[float, int, int]] = []  # (time, d_active, d_waiting)
    for r in recs:
        t0 = r.arrival_ms or 0.0
        deltas.append((t0, 1, 1))
        deltas.append((t0 + r.ttft_ms, 0, -1))
        deltas.append((t0 + r.latency_ms(), -1, 0))
    deltas.sort(key=lambda d: (d[0], d[1]))
    evs: list[dict[str, Any]] = []
    active = waiting = 0
    k = 0
    while k < len(deltas):
        t = deltas[k][0]
        while k < len(deltas) and deltas[k][0] == t:  # one sample per instant
            active += deltas[k][1]
            waiting += deltas[k][2]
            k += 1
        evs.append(_counter("active_requests", t, active))
        evs.append(_counter("waiting_requests", t, waiting))
    return evs


def _ctx_counters(recs: list[TraceRecord]) -> list[dict[str, Any]]:
    samples: dict[float, tuple[int, int]] = {}
    for r in recs:
        if r.itl_ctx is None or r.itl_ms is None:
            continue
        t = (r.arrival_ms or 0.0) + r.ttft_ms
        for gap, run, pre in zip(r.itl_ms, r.itl_ctx.num_running, r.itl_ctx.prefill_tokens):
            t += gap
            samples[round(t, 3)] = (run, pre)  # gaps of one step close at (about) one time
    evs: list[dict[str, Any]] = []
    for t in sorted(samples):
        run, pre = samples[t]
        evs.append(_counter("engine_running", t, run))
        evs.append(_counter("prefill_tokens", t, pre))
    return evs


def read_step_stats(path: str | Path) -> list[tuple[float, dict[str, Any]]]:
    """The `record --step-stats-out` sidecar: (ts_ms, SchedulerStats as a dict) per line."""
    out: list[tuple[float, dict[str, Any]]] = []
    for lineno, raw in iter_lines(path):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            out.append((float(obj["ts_ms"]), obj.get("scheduler") or {}))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a step-stats line ({e})") from None
    out.sort(key=lambda x: x[0])
    return out


def _sidecar_events(steps: list[tuple[float, dict[str, Any]]]) -> list[dict[str, Any]]:
    evs = [_meta_event("process_name", PID_STEPS, "scheduler steps"),
           _meta_event("thread_name", PID_STEPS, "steps", tid=0)]
    for k, (ts, s) in enumerate(steps):
        running = s.get("num_running_reqs", 0)
        evs.append(_counter("sched_running_reqs", ts, running))
        evs.append(_counter("sched_waiting_reqs", ts, s.get("num_waiting_reqs", 0)))
        evs.append(_counter("sched_kv_cache_usage", ts, s.get("kv_cache_usage", 0.0)))
        spec = s.get("spec_decoding_stats") or {}
        if isinstance(spec, dict) and spec.get("num_draft_tokens"):
            evs.append(_counter("sched_accept_rate", ts,
                                spec.get("num_accepted_tokens", 0) / spec["num_draft_tokens"]))
        if k + 1 < len(steps):
            nxt = steps[k + 1][0]
            evs.append({"name": f"step B{running}", "cat": "step", "ph": "X", "ts": _us(ts),
                        "dur": _us(max(nxt - ts, 0.0)), "pid": PID_STEPS, "tid": 0,
                        "cname": _COLOR_DECODE, "args": dict(s)})
    return evs


def to_chrome_trace(records: Iterable[TraceRecord], name: str = "inference trace",
                    track_per_request: bool = False,
                    step_stats: list[tuple[float, dict[str, Any]]] | None = None) -> dict[str, Any]:
    all_recs = list(records)
    recs = replay_subset(all_recs)
    if len(recs) < len(all_recs):
        log.warning("dropped %d records without arrival_ms", len(all_recs) - len(recs))
    if track_per_request:
        lanes = list(range(len(recs)))
    else:
        lanes = _assign_lanes([(r.arrival_ms or 0.0, (r.arrival_ms or 0.0) + r.latency_ms())
                               for r in recs])
    evs: list[dict[str, Any]] = [_meta_event("process_name", PID_TRACE, name)]
    for lane in sorted(set(lanes)):
        label = f"request {lane}" if track_per_request else f"lane {lane}"
        evs.append(_meta_event("thread_name", PID_TRACE, label, tid=lane))
    for i, (rec, lane) in enumerate(zip(recs, lanes)):
        evs.extend(_request_events(i, rec, lane))
    evs.extend(_step_counters(recs))
    evs.extend(_ctx_counters(recs))
    if step_stats:
        evs.extend(_sidecar_events(step_stats))
    return {"traceEvents": evs, "displayTimeUnit": "ms"}


def serve_once(body: bytes, port: int = 0) -> None:
    """Serve the JSON on 127.0.0.1 until interrupted and print the Perfetto UI link."""
    import http.server
    import urllib.parse

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # same body for any path
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    url = f"http://127.0.0.1:{srv.server_address[1]}/trace.json"
    ui = "https://ui.perfetto.dev/#!/?url=" + urllib.parse.quote(url, safe="")
    print(f"serving {url}\nopen {ui}\n(Ctrl-C to stop)", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
