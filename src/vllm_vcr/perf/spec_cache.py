"""What the estimator computes at start-up, kept on disk between processes.

Compiling an estimator (aiconfigurator-core's `EngineHandle.compile`) and its KV-cache memory
estimate read the package's YAML and tables: 1-2 CPU seconds, most of a short `simulate` run or
of `serve`'s start-up. What they produce is a few kilobytes of spec bytes (which load again in
under a millisecond) and a small dict. Both are kept under `$VLLM_VCR_CACHE_DIR` (default
`$XDG_CACHE_HOME/vllm-vcr`, else `~/.cache/vllm-vcr`) in `aic-specs/`, one file per identity:
the inputs, the aiconfigurator-core version and the data paths it reads, hashed.
`VLLM_VCR_PERF_CACHE=0` turns the cache off. A file that cannot be read or loaded is computed
afresh (and rewritten); one that cannot be written is skipped: the cache only ever saves time.

Loading a spec is cheap, but the estimator's first queries load its kernel tables (~0.5 CPU s).
So the answers to the two queries a step's price is made of (`decode_step_latency`,
`mixed_step_breakdown`) are kept too, per identity (`KeptPrices`): a later process asks the
estimator only what no earlier one asked, and loads it only then. Its answers are a pure
function of the spec and the query, so a kept answer is the answer.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

_DATA_VARS = ("AICONFIGURATOR_SYSTEMS_PATH", "AICONFIGURATOR_MODEL_CONFIGS_PATH")


def cache_dir() -> Path | None:
    """Where specs are kept (None: the cache is off)."""
    if os.environ.get("VLLM_VCR_PERF_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    root = os.environ.get("VLLM_VCR_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "vllm-vcr") if xdg else os.path.join(os.path.expanduser("~"), ".cache", "vllm-vcr")
    return Path(root) / "aic-specs"


def spec_key(kind: str, inputs: str) -> str:
    """The file name of what `inputs` give: everything the result depends on, hashed."""
    parts = [kind, inputs, aic_version(), *(os.environ.get(v, "") for v in _DATA_VARS)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def aic_version() -> str:
    """aiconfigurator-core's installed version ("unknown" when it is not installed): the `Version`
    field of the METADATA in the one `aiconfigurator_core-*.dist-info` beside the package, read
    without importlib.metadata, whose import and e-mail header parser cost a kept run ~20 ms; where
    that directory is not found alone, importlib.metadata's answer."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is not None and spec.origin:
        found = list(Path(spec.origin).parent.parent.glob("aiconfigurator_core-*.dist-info/METADATA"))
        if len(found) == 1:
            try:
                with found[0].open(encoding="utf-8") as f:
                    for line in f:
                        if not line.strip():
                            break  # the headers end at the first blank line
                        if line.startswith("Version:"):
                            return line[len("Version:"):].strip()
            except OSError:
                pass
    from importlib import metadata

    try:
        return metadata.version("aiconfigurator-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def load_or_compile(target_key: str, compile_spec: Callable[[], Any], from_spec: Callable[[bytes], Any]) -> Any:
    """The handle for `target_key`: loaded from its kept spec with `from_spec`, or made by
    `compile_spec` (a handle with `.spec_bytes`), whose spec is then kept."""
    root = cache_dir()
    path = root / f"{spec_key('spec', target_key)}.bin" if root is not None else None
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        if data:
            try:
                return from_spec(data)
            except Exception as e:  # noqa: BLE001 - a damaged or foreign file: compile afresh
                logger.debug("perf spec cache: %s does not load (%s); compiling", path, e)
    handle = compile_spec()
    if path is not None:
        _write(path, bytes(handle.spec_bytes))
    return handle


def load_or_compute(kind: str, inputs: dict[str, Any], compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`compute()` (a JSON-able dict, a pure function of `inputs`), or what it gave before."""
    root = cache_dir()
    key = json.dumps(inputs, sort_keys=True)
    path = root / f"{spec_key(kind, key)}.json" if root is not None else None
    if path is not None:
        try:
            kept = json.loads(path.read_text())
            if isinstance(kept, dict) and kept.get("inputs") == key:
                return kept["result"]
        except (OSError, ValueError, KeyError):
            pass
    result = compute()
    if path is not None:
        _write(path, json.dumps({"inputs": key, "result": result}).encode())
    return result


def _write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.debug("perf spec cache: cannot write %s (%s)", path, e)


_PRICE_QUERIES = ("decode_step_latency", "mixed_step_breakdown")
PRICES_MAX = 10_000  # answers kept per query and identity (~1.3 MB in all, ~50 ms to read; a full file keeps them)


class KeptPrices:
    """An estimator handle whose price queries are answered from the answers kept for its identity
    (see the module's docstring), the handle loaded by `load` at the first query that was never
    asked; anything else is the handle's. New answers are written back at exit (`save`)."""

    def __init__(self, path: Path, load: Callable[[], Any], kept: dict[str, dict], handle: Any = None) -> None:
        self._path = path
        self._load = load
        self._handle = handle
        self._kept = kept  # query name -> {args tuple: answer}
        self._new = 0
        self._saving = False

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self._load()
        return self._handle

    def _ask(self, query: str, args: tuple) -> Any:
        answers = self._kept[query]
        v = answers.get(args)
        if v is None:
            v = getattr(self.handle, query)(*args)
            if isinstance(v, list):
                v = tuple(v)
            answers[args] = v
            self._new += 1
            if not self._saving:
                self._saving = True
                atexit.register(self.save)
        return v

    def decode_step_latency(self, *args: Any) -> float:
        return self._ask("decode_step_latency", args)

    def mixed_step_breakdown(self, *args: Any) -> tuple:
        return self._ask("mixed_step_breakdown", args)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # (own state not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self.handle, name)

    def save(self) -> None:
        """Write the kept answers with the new ones (merged with what another process wrote meanwhile)."""
        if not self._new:
            return
        self._new = 0
        merged = _read_prices(self._path)
        for q in _PRICE_QUERIES:
            room = PRICES_MAX - len(merged[q])
            for args, v in self._kept[q].items():
                if room <= 0:
                    break
                if args not in merged[q]:
                    merged[q][args] = v
                    room -= 1
        data = {q: [[*args, v] for args, v in merged[q].items()] for q in _PRICE_QUERIES}
        _write(self._path, json.dumps(data, separators=(",", ":")).encode())


def _read_prices(path: Path) -> dict[str, dict]:
    """The answers kept in `path` ({} each when it is missing or unreadable)."""
    out: dict[str, dict] = {q: {} for q in _PRICE_QUERIES}
    try:
        data = json.loads(path.read_bytes())
        for q in _PRICE_QUERIES:
            answers = out[q]
            for row in data.get(q, ()):
                *args, v = row
                answers[tuple(args)] = tuple(v) if isinstance(v, list) else float(v)
    except (OSError, ValueError, TypeError, AttributeError):
        return {q: {} for q in _PRICE_QUERIES}
    return out


def kept_prices(target_key: str, load: Callable[[], Any]) -> Any:
    """The estimator for `target_key` behind its kept price answers. With none kept (or the cache
    off) the handle is loaded now (so a target it cannot price fails here, not at a step)."""
    root = cache_dir()
    if root is None:
        return load()
    path = root / f"{spec_key('prices', target_key)}.json"
    kept = _read_prices(path)
    if any(kept.values()):
        return KeptPrices(path, load, kept)
    return KeptPrices(path, load, kept, handle=load())
