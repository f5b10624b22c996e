"""The soak driver: many streaming requests at a fixed concurrency against a running `serve`, a
fraction of them cut mid-stream by the client. Used by test_soak.py and for docs/reliability.md:

    python -m tests.reliability.soak --url http://127.0.0.1:8000 --requests 10000 --concurrency 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

MODEL = "vllm-vcr/sim"


@dataclass
class SoakResult:
    requests: int = 0
    cut: int = 0  # streams the client closed on purpose
    done: int = 0  # uncut streams that ended with [DONE]
    bad: list[str] = field(default_factory=list)  # uncut streams that did not
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "cut": self.cut, "done": self.done, "bad": len(self.bad),
                "seconds": round(self.seconds, 2)}


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, cut_fraction: float,
               result: SoakResult) -> None:
    chat = rng.random() < 0.5
    max_tokens = rng.randint(4, 48)
    cut_after = rng.randint(1, max_tokens) if rng.random() < cut_fraction else None
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"soak {rng.random()}"}]}
    else:
        path, body = "/v1/completions", {"prompt": f"soak {rng.random()}"}
    if cut_after is not None:
        # room for 1000 more tokens after the cut (>= 2 s at the soak's 2 ms ITL): the engine is
        # still generating when the client goes away. The server writes ahead of a client that
        # reads late (the socket buffers hold hundreds of events), and on a loaded 2-core box a
        # client 200 streams wide fell 300 ms behind: 150 tokens of room let the engine finish
        # 11 of 187 cut streams before their client left.
        max_tokens += 1000
    body.update(model=MODEL, max_tokens=max_tokens, stream=True, ignore_eos=True)
    events = 0
    last = b""
    async with session.post(url + path, json=body) as resp:
        if resp.status != 200:
            result.bad.append(f"status {resp.status}: {(await resp.text())[:200]}")
            return
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            last = line.strip()
            if cut_after is not None and events >= cut_after:
                resp.close()  # a client that goes away mid-stream
                result.cut += 1
                return
    if last == b"data: [DONE]":
        result.done += 1
    else:
        result.bad.append(f"{path} ended with {last[:120]!r} after {events} events")


async def soak(url: str, requests: int, concurrency: int, cut_fraction: float = 0.2, seed: int = 0) -> SoakResult:
    rng = random.Random(seed)
    result = SoakResult(requests=requests)
    queue = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)

    async def worker(session: aiohttp.ClientSession) -> None:
        for _ in queue:
            try:
                await _one(session, url, rng, cut_fraction, result)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                result.bad.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    return result


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--cut", type=float, default=0.2)
    a = p.parse_args()
    print(json.dumps(asyncio.run(soak(a.url, a.requests, a.concurrency, a.cut)).as_dict()))


if __name__ == "__main__":
    main()
