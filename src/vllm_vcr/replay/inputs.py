"""The engine's inputs loaded from files: the latency model of `--latency-trace`, the planner of
`--replay-tokens` / `--replay-steps` and the table of `--response-replay-trace`; and the GPU
perf model of `--perf-model` (its estimator compiled by vllm_vcr.perf, not read from a file).

The engine loads no files: the CLIs (serve, play, calibrate) build these here and inject them
into every EngineCore they create. Each is built once per process and shared by all engines (one
planner per trace keeps consume-once matching global across engines). Each loader is imported
where its flag is given: a run without trace flags (a `simulate` run) loads none of them."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..engine.config import ConfigError, EngineArgs

if TYPE_CHECKING:
    from .table import ResponseReplayTable

T = TypeVar("T")


def engine_inputs(args: EngineArgs) -> dict[str, Any]:
    """The EngineCore keyword arguments for the trace flags in `args` (empty when none is set).

    A file that cannot be read or used is a ConfigError naming its flag."""
    inputs: dict[str, Any] = {}
    if args.latency_trace:
        inputs["latency"] = _load("--latency-trace", shared_latency_model, args.latency_trace, args.time_scale,
                                  args.latency_trace_model)
    if args.perf_model:  # --perf-model: the estimator compiled once per process (vllm_vcr.perf)
        from ..perf.aic import shared_step_latency

        inputs["latency"] = shared_step_latency(args.perf_model, args.time_scale)
    if args.replay_tokens or args.replay_steps:
        inputs["planner"] = _load("--replay-tokens/--replay-steps", shared_planner, args.replay_tokens,
                                  args.replay_steps, args.replay_match, args.tokens_per_block)
    if args.response_replay_trace:
        inputs["replay_table"] = _load("--response-replay-trace", shared_replay_table, args.response_replay_trace)
    return inputs


def _load(flag: str, loader: Callable[..., T], *args: Any) -> T:
    try:
        return loader(*args)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag}: {e}") from None


@functools.lru_cache(maxsize=8)
def shared_latency_model(path: str, time_scale: float, which: str = "auto"):
    from .latency_fit import load_latency_model

    return load_latency_model(path, time_scale, which)


@functools.lru_cache(maxsize=8)
def shared_planner(tokens: str | None, steps: str | None, match: str, block_size: int):
    from .planner import build_planner

    return build_planner(tokens, steps, match, block_size)


@functools.lru_cache(maxsize=8)
def shared_replay_table(path: str) -> ResponseReplayTable:
    from .table import ResponseReplayTable

    return ResponseReplayTable.from_path(path)


def clear_shared_inputs() -> None:
    """Forget the loaded inputs (tests that rewrite a trace file under the same path)."""
    for f in (shared_latency_model, shared_planner, shared_replay_table):
        f.cache_clear()
