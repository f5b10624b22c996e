"""Helpers for the control API tests.

`VirtualEngine`: one real EngineCore on the virtual clock, stepped by the test (exact timings).
"""

from __future__ import annotations

import socket

import msgspec

from tests.conftest import free_port  # noqa: F401  (re-exported for the control tests)

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreOutputs, EngineCoreRequest, SamplingParams

_CFG = set(EngineConfig.__struct_fields__)


def engine_args(**kw) -> EngineArgs:
    # convert, not the constructor: it turns "error" into FailureType.ERROR as the CLI would
    cfg = msgspec.convert({k: v for k, v in kw.items() if k in _CFG}, EngineConfig)
    return EngineArgs(config=cfg, **{k: v for k, v in kw.items() if k not in _CFG}).validate()


def make_request(rid: str, prompt_len: int = 8, max_tokens: int | None = 4, **sp) -> EngineCoreRequest:
    base = sum(map(ord, rid)) * 1009  # distinct prompts: no accidental prefix hits
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=[(base + i) % 30000 + 1 for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, **sp))


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class VirtualEngine:
    """An EngineCore on a VirtualClock; `run(until)` steps it, control calls go through core.call."""

    def __init__(self, **kw) -> None:
        self.clock = VirtualClock(0.0)
        self.batches: list[EngineCoreOutputs] = []
        self.core = EngineCore(engine_args(**kw), clock=self.clock, output_sink=lambda c, o: self.batches.append(o))

    def add(self, rid: str, **kw) -> None:
        self.core.add_request(make_request(rid, **kw))

    def run(self, until: float | None = None) -> None:
        self.core.run_until_idle(until=until)

    def call(self, fn):
        """core.call(fn), answered at the next step boundary (processed right away here)."""
        fut = self.core.call(fn)
        self.core.run_until_idle(until=self.clock.now())
        assert fut.done()
        return fut.result()

    def token_times(self, rid: str) -> list[float]:
        return [b.timestamp for b in self.batches for o in b.outputs if o.request_id == rid and o.new_token_ids]

    def finish_reason(self, rid: str):
        rs = [o.finish_reason for b in self.batches for o in b.outputs
              if o.request_id == rid and o.finish_reason is not None]
        return rs[-1] if rs else None
