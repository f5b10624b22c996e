"""LoRA adapters in the engine: vLLM's batch limit and adapter residency, as time.

vLLM's scheduler admits a waiting request only if its adapter is already among the batch's
adapters or the batch has fewer than `max_loras` of them (`admissible`). Its worker keeps
adapters in two LRU caches: `max_loras` GPU slots and a CPU pool of `max_cpu_loras`; an adapter
missing from the GPU slots is copied in from the CPU pool (swap-in), one missing from both is
read from disk first (load). `LoRAResidency.activate` replays that bookkeeping for one step's
batch and returns the extra time the step takes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


def admissible(lora_id: int | None, batch_loras: set[int], max_loras: int) -> bool:
    """vLLM's max_loras check for one waiting request against the adapters already scheduled."""
    if not lora_id or lora_id <= 0:
        return True
    return lora_id in batch_loras or len(batch_loras) < max_loras


class LoRAResidency:
    """GPU slots and the CPU pool, both LRU; seconds of loading per step."""

    def __init__(self, max_loras: int, max_cpu_loras: int, load_time: float, swap_in_time: float):
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}).")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.load_time = load_time
        self.swap_in_time = swap_in_time
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.loads = 0
        self.swap_ins = 0

    def activate(self, lora_ids: Iterable[int]) -> float:
        """Make a batch's adapters resident; the time it costs (0 when all are in GPU slots)."""
        batch = [i for i in dict.fromkeys(lora_ids) if i and i > 0]
        cost = 0.0
        for lid in batch:
            if lid in self.gpu:
                self.gpu.move_to_end(lid)
                self.cpu.move_to_end(lid)
                continue
            if lid in self.cpu:
                self.cpu.move_to_end(lid)
                self.swap_ins += 1
                cost += self.swap_in_time
            else:
                self.cpu[lid] = None
                self.loads += 1
                cost += self.load_time + self.swap_in_time
            self.gpu[lid] = None
        self._evict(self.gpu, self.max_loras, keep=set(batch))
        self._evict(self.cpu, self.max_cpu_loras, keep=set(self.gpu))
        return cost

    @staticmethod
    def _evict(cache: OrderedDict[int, None], capacity: int, keep: set[int]) -> None:
        for lid in list(cache):
            if len(cache) <= capacity:
                return
            if lid not in keep:
                del cache[lid]
