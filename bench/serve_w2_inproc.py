"""`serve`'s own Python work per SSE event at W2's shape, without sockets and on the virtual clock.

The real app (build_app) behind real uvicorn httptools request cycles whose transport only counts
the bytes it is given; the real AsyncEngine on a VirtualClock (its loop jumps to the next
deadline whenever nothing else is ready), so what runs, and how many events a step carries,
follow from the code alone, not from the box's load. A closed loop of C streaming chat requests
(TTFT 100 ms, ITL 20 ms, OSL 100, ISL ~128, `continuous_usage_stats`, one token per event), the
first C arriving `--arrival-gap-us` of virtual time apart: 20 µs (the default, kept so counts stay
comparable with earlier ones) gives about ten decodes per step; 0 gives what the real W2 run shows
(its opening requests arrive together and later ones as the earlier end, so most decodes of a wave
fall due together: `run_bench.py` reports 100-1,000 tokens per engine step at C=1000).

What it leaves out: the socket writes and reads (the same for any server, see null_sse_server.py),
the HTTP parsing of requests. What remains is the server's per-event and per-request Python: the
engine step, the hand-off, the rendering, the framing, the metrics.

  PYTHONPATH=src python bench/serve_w2_inproc.py [--concurrency 1000] [--requests 3000] [--repeat 3]
  # instructions per event (box-independent): counters zeroed before each measured phase, dumped after
  PYTHONHASHSEED=0 PYTHONPATH=src valgrind --tool=callgrind --callgrind-out-file=/tmp/cg/cg.%p \
      python bench/serve_w2_inproc.py --requests 1000 --repeat 1 --callgrind /tmp/cg
  # what a request, a step and an event cost on their own: the total `instructions` of three such runs
  # (--arrival-gap-us 20, --arrival-gap-us 2, --osl 2) against their requests, steps and events
  # Python bytecodes per event, per function (deterministic; slow under the tracer):
  PYTHONPATH=src python bench/serve_w2_inproc.py --requests 300 --repeat 1 --bytecodes
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import os
import subprocess
import sys
import time
from email.utils import formatdate
from pathlib import Path

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from vllm_vcr.engine.async_engine import AsyncEngine
from vllm_vcr.engine.block_hash import ContentHasher
from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.gc_tuning import tune_for_serving
from vllm_vcr.http.uvicorn_internals import ON_DISCONNECT
from vllm_vcr.serve.app import build_app
from vllm_vcr.http.serving_base import ServeSettings
from vllm_vcr.frontend.tokenizer import load_tokenizer

PEERS = Path(os.environ.get("VLLM_VCR_PEERS") or Path.home() / ".cache/vllm-vcr/peers")  # as install-peers-bench.sh
ARRIVAL_GAP = 0.00002  # virtual seconds between the opening requests


class PacedClock(VirtualClock):
    """A virtual clock the driver holds back: the engine's loop jumps to its next deadline, but no
    further than `horizon`, so the opening requests reach the engine ARRIVAL_GAP apart."""

    horizon = float("inf")

    def advance_to(self, t: float) -> None:
        super().advance_to(min(t, self.horizon))


class CountingTransport:
    """What a cycle writes to: counts writes and bytes, never pushes back."""

    def __init__(self) -> None:
        self.writes = 0
        self.nbytes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.nbytes += len(data)

    def is_closing(self) -> bool:
        return False

    # its own protocol, as far as a steady batch asks: one that reports a socket that stops taking
    # writes (serve's does, http/acceptor.py); this one never stops
    reports_write_side = True

    def get_protocol(self) -> CountingTransport:
        return self

    def get_extra_info(self, name: str, default=None):
        return default

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...


def body_for(prompt: str, osl: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": osl,
                       "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()


def scope_for(body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 40000), "scheme": "http", "method": "POST",
            "root_path": "", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())],
            ON_DISCONNECT: None}  # (serve's protocol reports disconnects: acceptor.py)


class Driver:
    def __init__(self, app, transport: CountingTransport, bodies: list[bytes]) -> None:
        self.app, self.transport, self.bodies = app, transport, bodies
        self.started = self.done = 0
        self.log = logging.getLogger("serve_w2_inproc")
        self.all_done = asyncio.Event()
        self.limit = 0
        self.arrival_gap = ARRIVAL_GAP
        # one list for every request, as uvicorn's server shares its default headers (a new list
        # when the date changes, once a second)
        self.default_headers = [(b"date", formatdate(usegmt=True).encode()), (b"server", b"uvicorn")]

    def start_one(self) -> None:
        body = self.bodies[self.started % len(self.bodies)]
        self.started += 1
        t = self.transport
        cycle = RequestResponseCycle(scope_for(body), t, FlowControl(t), self.log, self.log, False, self.default_headers,
                                     asyncio.Event(), False, True, self.on_response)
        cycle.body = bytearray(body)
        cycle.more_body = False
        cycle.message_event.set()
        asyncio.get_running_loop().create_task(cycle.run_asgi(self.app))

    def on_response(self) -> None:
        self.done += 1
        if self.started < self.limit:
            self.start_one()
        elif self.done == self.limit:
            self.all_done.set()


async def run_phase(driver: Driver, engine: AsyncEngine, clock: PacedClock, conc: int, n: int) -> None:
    """n requests, at most conc at a time; each finish starts the next (closed loop)."""
    driver.limit = driver.started + n
    driver.all_done.clear()
    admitted = engine.engines[0].requests
    for i in range(min(conc, n)):
        clock.horizon = clock.now() + driver.arrival_gap
        before = len(admitted)
        driver.start_one()
        while len(admitted) == before:  # until the engine has it (the clock waits at the horizon)
            await asyncio.sleep(0)
    clock.horizon = float("inf")
    await driver.all_done.wait()


def dumped_instructions(out_dir: Path) -> int:
    """Dump callgrind's counters for this process and read the dump's total (Ir)."""
    before = set(out_dir.iterdir())
    subprocess.run(["callgrind_control", "-d", str(os.getpid())], check=True, capture_output=True)
    for _ in range(600):
        for path in set(out_dir.iterdir()) - before:
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.5)
    raise RuntimeError("callgrind dump not found")


def opcode_counter(counts: collections.Counter):
    """A sys.settrace tracer counting the Python bytecodes executed, per function."""
    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[(code.co_filename.rsplit("/", 1)[-1], code.co_name)] += 1
        return tracer
    return tracer


async def measured(driver: Driver, engine: AsyncEngine, clock: PacedClock, conc: int, n: int,
                   callgrind: str | None, bytecodes: bool, top: int = 25) -> dict:
    t = driver.transport
    if callgrind:
        subprocess.run(["callgrind_control", "-z", str(os.getpid())], check=True, capture_output=True)
    counts: collections.Counter = collections.Counter()
    if bytecodes:
        sys.settrace(opcode_counter(counts))
    w0, c0 = t.writes, time.process_time()
    steps0 = engine.engines[0].step_counter
    await run_phase(driver, engine, clock, conc, n)
    sys.settrace(None)
    steps = engine.engines[0].step_counter - steps0
    cpu, writes = time.process_time() - c0, t.writes - w0
    events = writes - 2 * n  # less each response's headers and its final write
    row = {"requests": n, "events": events, "steps": steps, "events_per_step": round(events / steps, 1),
           "cpu_us_per_event": round(cpu / events * 1e6, 3)}
    if callgrind:
        row["instructions"] = total = dumped_instructions(Path(callgrind))
        row["instructions_per_event"] = round(total / events)
    if bytecodes:
        row["bytecodes_per_event"] = round(sum(counts.values()) / events, 1)
        row["bytecodes_per_event_by_function"] = {f"{f}:{name}": round(c / events, 1)
                                                  for (f, name), c in counts.most_common(top)}
    return row


async def main_async(a: argparse.Namespace) -> None:
    model_dir = Path(a.model_dir)
    tok = load_tokenizer(model_dir)
    clock = PacedClock(0.0)
    args = EngineArgs(config=EngineConfig(inter_token_latency=20.0, time_to_first_token=100.0, max_num_seqs=2048,
                                          log_requests=False),
                      vocab_size=tok.vocab_size, kv_cache_size=65536, eos_token_id=tok.eos_token_id).validate()
    engine = AsyncEngine(args, clock=clock, block_hasher=ContentHasher())  # (serve's, without KV events)
    await engine.start()
    app = build_app(engine, tok, ServeSettings(served_model_names=["m"]))
    rng = random.Random(7)
    prompts = [tok.decode([rng.randrange(tok.vocab_size) for _ in range(128)]) for _ in range(512)]
    driver = Driver(app, CountingTransport(), [body_for(p, a.osl) for p in prompts])
    driver.arrival_gap = a.arrival_gap_us / 1e6
    await run_phase(driver, engine, clock, a.concurrency, 512)  # warm-up: every prompt's render and encode cached
    tune_for_serving()
    for _ in range(a.repeat):
        print(json.dumps(await measured(driver, engine, clock, a.concurrency, a.requests, a.callgrind,
                                        a.bytecodes, a.top)), flush=True)
    await engine.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--osl", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--arrival-gap-us", type=float, default=ARRIVAL_GAP * 1e6,
                    help="virtual time between the opening requests: how many decodes fall due together, "
                         "so how many events a step carries")
    ap.add_argument("--model-dir", default=str(PEERS / "bench-tinymodel"))
    ap.add_argument("--callgrind", metavar="DIR", help="running under callgrind (its --callgrind-out-file in DIR): "
                                                         "also report instructions per event")
    ap.add_argument("--bytecodes", action="store_true",
                    help="count the Python bytecodes executed per event, per function (sys.settrace: slow; "
                         "use ~300 requests)")
    ap.add_argument("--top", type=int, default=25, help="with --bytecodes: how many functions to list")
    a = ap.parse_args()
    try:
        import uvloop
        uvloop.run(main_async(a))
    except ImportError:
        asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
