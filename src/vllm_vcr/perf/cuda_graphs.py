"""Which steps vLLM runs without CUDA graphs, and the host time that costs.

vLLM captures CUDA graphs for batches of up to `max_cudagraph_capture_size` tokens
(`vllm/config/vllm.py` `_set_cudagraph_sizes`): a step of more tokens runs the compiled model
without a graph, launching every kernel of every layer from the CPU (and each TP rank its
collectives); a step within the capture size replays a graph (padded to the next captured size).
The capture size, unless given (`--max-cudagraph-capture-size`, `--cudagraph-capture-sizes`,
`--compilation-config`), is `min(2 x max_num_seqs, 512)`, 1024 on data-center Blackwell (vLLM
from mid-2026; 512 for every release before), and never above `max_num_batched_tokens`; the
captured sizes are 1, 2, 4, multiples of 8 up to 256 and of 16 beyond, plus the budget when it
fits, so the largest one is the effective maximum. The graph mode decides which steps may
replay one: `FULL_AND_PIECEWISE` (the default) and `PIECEWISE` / `FULL` any step within the
capture size, `FULL_DECODE_ONLY` only decode-only steps (a step with a prefill always runs
without), `NONE` (or `--enforce-eager`) none.

The step-time term itself (the engine's host time for a step without graphs, per layer) is in
engine/latency/aic.py; off unless `--perf-eager-layer-us` sets it (fitted on the training split,
it priced the held-out configurations worse: docs/fidelity.md).
"""

from __future__ import annotations

from typing import Any

from .catalog import BLACKWELL_GPUS
from .errors import PerfModelError, json_flag
from .qk_norm import bundled_config

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
DEFAULT_MODE = "FULL_AND_PIECEWISE"


def captured_sizes_max(ceiling: int, max_num_batched_tokens: int) -> int:
    """The largest captured size under `ceiling` (vLLM's default grid, with the budget appended
    when it fits): what `max_cudagraph_capture_size` ends up as."""
    cap = min(ceiling, max_num_batched_tokens)
    if cap < 1:
        return 0
    grid = [s for s in (1, 2, 4) if s <= cap] + list(range(8, min(cap + 1, 256), 8)) + list(range(256, cap + 1, 16))
    if max_num_batched_tokens <= cap:
        grid.append(max_num_batched_tokens)
    return max(grid)


def capture_size(gpu: str, max_num_seqs: int, max_num_batched_tokens: int, *, given: int | None = None,
                 sizes: list[int] | None = None, blackwell_1024: bool = True) -> int:
    """vLLM's effective `max_cudagraph_capture_size` for an engine (0: no graphs).
    `blackwell_1024`: the release has the 1024 default on Blackwell (False for the releases
    before mid-2026, e.g. every silicon row's)."""
    if sizes:
        kept = [s for s in sizes if s <= max_num_batched_tokens]
        return max(kept) if kept else 0
    if given is None:
        ceiling = 1024 if blackwell_1024 and gpu in BLACKWELL_GPUS else 512
        given = min(2 * max_num_seqs, ceiling)
        # max_num_seqs itself is captured as a uniform decode size when it fits
        return max(captured_sizes_max(given, max_num_batched_tokens),
                   max_num_seqs if max_num_seqs <= min(given, max_num_batched_tokens) else 0)
    return captured_sizes_max(given, max_num_batched_tokens)


def mode_of(value: Any) -> str:
    """A graph mode as vLLM spells it (name, any case, or its enum number)."""
    if isinstance(value, int) and not isinstance(value, bool):
        numbered = {0: "NONE", 1: "PIECEWISE", 2: "FULL", 3: "FULL_DECODE_ONLY", 4: "FULL_AND_PIECEWISE"}
        if value in numbered:
            return numbered[value]
    if isinstance(value, str) and value.upper() in MODES:
        return value.upper()
    raise PerfModelError(f"--compilation-config: cudagraph_mode must be one of {', '.join(MODES)}, got {value!r}")


def from_compilation_config(value: str | dict | None) -> dict[str, Any]:
    """The graph settings of `--compilation-config` (JSON; vLLM's `-cc` too): `cudagraph_mode`,
    `max_cudagraph_capture_size`, `cudagraph_capture_sizes`. {} when it sets none."""
    if value is None:
        return {}
    if isinstance(value, str) and value.strip().isdigit():  # `-O3` / `-cc 3`: an optimisation level
        return {}
    value = json_flag(value, "--compilation-config")
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    if "cudagraph_mode" in value and value["cudagraph_mode"] is not None:
        out["mode"] = mode_of(value["cudagraph_mode"])
    given, sizes = value.get("max_cudagraph_capture_size"), value.get("cudagraph_capture_sizes")
    if given is not None:
        out["given"] = _size(given, "max_cudagraph_capture_size")
    if sizes:
        if not isinstance(sizes, list):
            raise PerfModelError(f"--compilation-config: cudagraph_capture_sizes must be a list, got {sizes!r}")
        out["sizes"] = [_size(v, "cudagraph_capture_sizes") for v in sizes]
    return out


def _size(v: Any, field: str) -> int:
    """A capture size (an integer, or its digits as a string, as vLLM's config model takes it)."""
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).strip().isdigit():
        raise PerfModelError(f"--compilation-config: {field} takes integers >= 0, got {v!r}")
    return int(v)


def num_layers(model: str) -> int:
    """Decoder layers of a bundled model (0 when its config is not bundled)."""
    cfg = bundled_config(model)
    cfg = cfg.get("text_config") or cfg
    return int(cfg.get("num_hidden_layers") or 0)


def eager_step_ms(model: str, tensor_parallel_size: int, layer_us: float, layer_tp_us: float) -> float:
    """Host time of a step run without CUDA graphs (`model`: a bundled name): per layer, plus per
    layer the TP ranks' collectives when TP > 1."""
    return num_layers(model) * (layer_us + (layer_tp_us if tensor_parallel_size > 1 else 0.0)) / 1e3
