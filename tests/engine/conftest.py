"""Engine tests run on the virtual clock: no sleeping, fully deterministic."""

from __future__ import annotations

import pytest

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.replay.inputs import engine_inputs
from vllm_vcr.engine.types import EngineCoreOutputs, EngineCoreRequest, SamplingParams


class Harness:
    """An EngineCore on a VirtualClock that records every output batch."""

    def __init__(self, *, start: float = 0.0, latency=None, textless_ids=(), **kwargs) -> None:
        cfg_fields = set(EngineConfig.__struct_fields__)
        cfg = EngineConfig(**{k: v for k, v in kwargs.items() if k in cfg_fields})
        args = EngineArgs(config=cfg, **{k: v for k, v in kwargs.items() if k not in cfg_fields})
        self.clock = VirtualClock(start)
        self.batches: list[tuple[int, EngineCoreOutputs]] = []
        args = args.validate()
        inputs = engine_inputs(args)
        if latency is not None:
            inputs["latency"] = latency
        self.core = EngineCore(args, clock=self.clock, output_sink=lambda c, o: self.batches.append((c, o)),
                               textless_ids=frozenset(textless_ids), **inputs)

    def add(self, rid: str, prompt_len: int = 16, max_tokens: int | None = 4, *, prompt: list[int] | None = None,
            priority: int = 0, arrival_time: float = 0.0, **sp) -> None:
        tokens = prompt if prompt is not None else self.prompt_of(rid, prompt_len)
        self.core.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=max_tokens, **sp),
            priority=priority, arrival_time=arrival_time))

    @staticmethod
    def prompt_of(rid: str, length: int) -> list[int]:
        # distinct prompts per request id unless given, so prefix hits only happen on purpose
        base = sum(map(ord, rid)) * 1009
        return [(base + i) % 30000 + 1 for i in range(length)]

    def add_req(self, req: EngineCoreRequest) -> None:
        self.core.add_request(req)

    def run(self, until: float | None = None) -> None:
        self.core.run_until_idle(until=until)

    def outputs(self, rid: str):
        """(timestamp, EngineCoreOutput) for one request, in order."""
        return [(b.timestamp, o) for _, b in self.batches for o in b.outputs if o.request_id == rid]

    def tokens(self, rid: str) -> list[int]:
        return [t for _, o in self.outputs(rid) for t in o.new_token_ids]

    def finish(self, rid: str):
        outs = [o for _, o in self.outputs(rid) if o.finish_reason is not None]
        return outs[-1].finish_reason if outs else None

    def emission_times(self, rid: str) -> list[float]:
        return [t for t, o in self.outputs(rid) if o.new_token_ids]

    def stats(self):
        return self.core.current_stats()


@pytest.fixture
def harness():
    return Harness
