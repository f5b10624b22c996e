"""The estimator loaded from its kept spec without the SDK's Python layer.

aiconfigurator-core's `EngineHandle` (sdk/engine.py) is a thin wrapper over its compiled
`AicEngine`; importing it imports the SDK (numpy, its model and config builders: ~0.08 CPU s),
which a process that only prices steps from a kept spec does not need. `NativeHandle` asks the
compiled engine the two price queries directly, with the arguments `EngineHandle` passes
(its defaults for the imbalance scales), and hands anything else to an `EngineHandle` made on
first use. tests/perf/test_compact_tables.py checks its answers against `EngineHandle`'s; the
signatures are the package's internals, pinned below 0.13 in pyproject.toml.
"""

from __future__ import annotations

from typing import Any


class NativeHandle:
    """`EngineHandle`'s price queries on the compiled engine, the rest on an `EngineHandle`."""

    def __init__(self, spec_bytes: bytes, *, systems_path: str | None = None) -> None:
        import aiconfigurator_core

        self.spec_bytes = bytes(spec_bytes)
        self._systems_path = systems_path
        self._engine = aiconfigurator_core.AicEngine.from_spec(self.spec_bytes, systems_path)
        self._sdk: Any = None

    def decode_step_latency(self, gen_tokens: int, isl: int, osl: int,
                            gen_seq_imbalance_correction_scale: float = 1.0) -> float:
        return self._engine.decode_step_latency(int(gen_tokens), int(isl), int(osl),
                                                float(gen_seq_imbalance_correction_scale))

    def mixed_step_breakdown(self, ctx_tokens: int, gen_tokens: int, isl: int, osl: int, prefix: int = 0,
                             seq_imbalance_correction_scale: float = 1.0,
                             gen_seq_imbalance_correction_scale: float = 1.0) -> tuple:
        return self._engine.mixed_step_breakdown(int(ctx_tokens), int(gen_tokens), int(isl), int(osl), int(prefix),
                                                 float(seq_imbalance_correction_scale),
                                                 float(gen_seq_imbalance_correction_scale))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._sdk is None:
            from aiconfigurator_core.sdk.engine import EngineHandle

            self._sdk = EngineHandle(self.spec_bytes, systems_path=self._systems_path)
        return getattr(self._sdk, name)
