"""Routers in the loop: which of N engines gets a request.

- `round_robin`: in turn.
- `least_loaded`: the engine with the fewest requests in flight (ties: fewer tokens in flight).
- `kv`: KV-prefix aware, in the manner of Dynamo's approximate KV router and llm-d's prefix
  scorer: the router remembers which prompt blocks it sent to each engine (chained block keys,
  at most the engine's KV cache size per engine, least recently used forgotten first) and picks
  the engine with the lowest cost = blocks the engine would have to prefill + blocks in flight
  there × `load_weight`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

ROUTERS = ("round_robin", "least_loaded", "kv")


class Router(Protocol):
    def route(self, prompt: list[int]) -> int: ...

    def on_start(self, engine: int, prompt: list[int], max_tokens: int) -> None: ...

    def on_finish(self, engine: int, prompt_len: int, max_tokens: int) -> None: ...


class _Load:
    def __init__(self, num_engines: int) -> None:
        self.n = num_engines
        self.requests = [0] * num_engines
        self.tokens = [0] * num_engines

    def on_start(self, engine: int, prompt: list[int], max_tokens: int) -> None:
        self.requests[engine] += 1
        self.tokens[engine] += len(prompt) + max_tokens

    def on_finish(self, engine: int, prompt_len: int, max_tokens: int) -> None:
        self.requests[engine] -= 1
        self.tokens[engine] -= prompt_len + max_tokens


class RoundRobin(_Load):
    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self._next = 0

    def route(self, prompt: list[int]) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


class LeastLoaded(_Load):
    def route(self, prompt: list[int]) -> int:
        return min(range(self.n), key=lambda i: (self.requests[i], self.tokens[i], i))


class KvPrefixRouter(_Load):
    def __init__(self, num_engines: int, block_size: int, capacity_blocks: int, load_weight: float = 1.0) -> None:
        super().__init__(num_engines)
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.load_weight = load_weight
        self.index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]

    def _keys(self, prompt: list[int]) -> list[int]:
        bs = self.block_size
        keys, parent = [], 0
        for j in range(0, len(prompt) - bs + 1, bs):
            parent = hash((parent, tuple(prompt[j:j + bs])))
            keys.append(parent)
        return keys

    def route(self, prompt: list[int]) -> int:
        keys = self._keys(prompt)
        total = len(keys)
        best, best_cost = 0, None
        for i in range(self.n):
            idx = self.index[i]
            hit = 0
            for k in keys:
                if k not in idx:
                    break
                hit += 1
            in_flight = self.tokens[i] / self.block_size
            cost = (total - hit) + self.load_weight * in_flight
            if best_cost is None or cost < best_cost:
                best, best_cost = i, cost
        self._remember(best, keys)
        return best

    def _remember(self, engine: int, keys: list[int]) -> None:
        idx = self.index[engine]
        for k in keys:
            idx[k] = None
            idx.move_to_end(k)
        while len(idx) > self.capacity:
            idx.popitem(last=False)


def make_router(name: str, num_engines: int, *, block_size: int, capacity_blocks: int) -> Router:
    if name == "round_robin":
        return RoundRobin(num_engines)
    if name == "least_loaded":
        return LeastLoaded(num_engines)
    if name == "kv":
        return KvPrefixRouter(num_engines, block_size, capacity_blocks)
    raise ValueError(f"--router: unknown router {name!r}; choose from {', '.join(ROUTERS)}")
