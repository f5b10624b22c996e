"""A FaultController whose state is shared by the processes of one server (`serve --api-server-count N`).

The fault script (rules, their counts, the requests seen), the scripted gauges, the rates and
the injected counts live in one file, read and written under an exclusive `flock`: a rule that
fails "the next 5" fails 5 requests in all, whichever API server each reaches, `request_index`
counts every process's requests, and a gauge has the same start time everywhere. Every process
(the parent serving the control API and each API server) opens the file itself; the parent
creates it in the server's private directory before it starts the others.

The first bytes of the file are mapped: a version, bumped on every write, a flag "a fault may
apply", so a request with nothing configured costs one byte read and no lock, and the gauges'
epoch, bumped when gauges are set or cleared (an API server's /metrics files re-stamp its gauges
when it changes: vllm/metrics_multiproc.py).

    offset 0: u64 version   8: u8 may_fault   9: u8 has_gauges   16: u32 body length
    24: u32 gauges epoch    64: body (msgpack)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time

import msgspec
from collections.abc import Callable, Iterator
from typing import Any

from .controller import FaultController
from .rates import FaultRates
from .gauges import GaugeScript
from .rules import FaultAction, FaultScript, RequestInfo

HEADER = 64
_VERSION = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
_MAY_FAULT, _HAS_GAUGES, _LENGTH_AT, _EPOCH_AT = 8, 9, 16, 24
_encoder, _decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


class SharedFaultController(FaultController):
    """FaultController over a state file. `create=True` (once, by the parent) writes the initial
    state from `rates`; the others attach to it. Every public method sees and leaves the shared state."""

    def __init__(self, path: str, *, create: bool, rates: FaultRates | None = None, model: str = "vllm-vcr/sim",
                 max_model_len: int = 4096, seed: int | str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # time.monotonic is CLOCK_MONOTONIC: one clock for every process of the machine, so a rule's
        # deadline and a gauge's start time mean the same everywhere
        self._fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
        if create:
            os.ftruncate(self._fd, HEADER)
        self._mm = mmap.mmap(self._fd, HEADER)
        self._version = -1
        super().__init__(rates, model=model, max_model_len=max_model_len, seed=None, clock=clock)
        import random

        self._rng = random.Random(seed)
        if create:
            with self._locked(write=True, load=False):
                pass

    # ---- the file ----------------------------------------------------------------------------
    @property
    def active(self) -> bool:  # read per request by the HTTP fault gate
        return self._mm[_MAY_FAULT] != 0

    @active.setter
    def active(self, value: bool) -> None:
        pass  # the flag is the file's (written with the state)

    def _refresh(self) -> None:
        pass

    @contextlib.contextmanager
    def _locked(self, write: bool, load: bool = True) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if load:
                version = _VERSION.unpack_from(self._mm, 0)[0]
                if version != self._version:
                    length = _LENGTH.unpack_from(self._mm, _LENGTH_AT)[0]
                    body = os.pread(self._fd, length, HEADER)
                    state = _decoder.decode(body)
                    self.script = FaultScript.from_state(state["script"])
                    self.gauges = GaugeScript.from_state(state["gauges"])
                    self.rates = msgspec.convert(state["rates"], FaultRates)
                    self.injected = state["injected"]
                    self._version = version
            yield
            if write:
                body = _encoder.encode({"script": self.script.to_state(), "gauges": self.gauges.to_state(),
                                        "rates": msgspec.to_builtins(self.rates), "injected": self.injected})
                os.pwrite(self._fd, body, HEADER)
                self._version = _VERSION.unpack_from(self._mm, 0)[0] + 1
                _LENGTH.pack_into(self._mm, _LENGTH_AT, len(body))
                self._mm[_MAY_FAULT] = 1 if (self.script or self.rates.any()) else 0
                self._mm[_HAS_GAUGES] = 1 if self.gauges else 0
                _VERSION.pack_into(self._mm, 0, self._version)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # ---- per request -------------------------------------------------------------------------
    def decide(self, info: RequestInfo) -> FaultAction | None:
        with self._locked(write=True):
            return super().decide(info)

    def from_header(self, value: bytes) -> FaultAction:
        with self._locked(write=True):
            return super().from_header(value)

    def gauge_value(self, name: str) -> float | None:
        if not self._mm[_HAS_GAUGES]:
            return None
        with self._locked(write=False):
            return super().gauge_value(name)

    # ---- control API -------------------------------------------------------------------------
    def set_script(self, body: Any) -> dict[str, Any]:
        with self._locked(write=True):
            return super().set_script(body)

    def clear_script(self) -> None:
        with self._locked(write=True):
            super().clear_script()

    def describe_script(self) -> dict[str, Any]:
        with self._locked(write=False):
            return super().describe_script()

    def check_rates(self, patch: dict[str, Any]) -> FaultRates:
        with self._locked(write=False):
            return super().check_rates(patch)

    def patch_rates(self, patch: dict[str, Any]) -> dict[str, Any]:
        with self._locked(write=True):
            return super().patch_rates(patch)

    def rates_dict(self) -> dict[str, Any]:
        with self._locked(write=False):
            return super().rates_dict()

    def set_gauges(self, body: Any) -> dict[str, dict]:
        with self._locked(write=True):
            out = super().set_gauges(body)
            self._bump_gauges_epoch()
            return out

    def clear_gauges(self) -> None:
        with self._locked(write=True):
            super().clear_gauges()
            self._bump_gauges_epoch()

    def _bump_gauges_epoch(self) -> None:
        _LENGTH.pack_into(self._mm, _EPOCH_AT, (self.gauges_epoch() + 1) & 0xFFFFFFFF)

    def gauges_epoch(self) -> int:
        """How many times the gauges were set or cleared (mod 2**32), by any process."""
        return _LENGTH.unpack_from(self._mm, _EPOCH_AT)[0]

    def describe_gauges(self) -> dict[str, dict]:
        with self._locked(write=False):
            return super().describe_gauges()

    def stats(self) -> dict[str, Any]:
        with self._locked(write=False):
            return super().stats()

    def reset_stats(self) -> None:
        with self._locked(write=True):
            super().reset_stats()
