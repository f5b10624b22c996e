"""`vllm-vcr play`: join a real vLLM frontend started with external engines."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import event_loop
from ..engine.config import ConfigError, EngineArgs
from ..engine_cli import add_engine_args, add_running_limit_args, engine_args_from_cli
from ..gc_tuning import tune_for_serving
from ..kv_events.config import KVEventsConfigError, add_kv_events_args, kv_events_config_from_cli
from ..perf.cli import add_perf_args

log = logging.getLogger("vllm_vcr.wire")

DEFAULT_HANDSHAKE = "tcp://127.0.0.1:29550"
# A real GPU step is never ~0 µs (a small model's decode step on a fast GPU takes 2-3 ms), and a
# vLLM frontend merges every step's output it finds queued when it gets round to reading: at
# latency 0, steps 2 ms apart let a frontend that is not overloaded send one token per SSE event.
DEFAULT_MIN_STEP_TIME_MS = 2.0
# Without MODEL (or --vocab-size) output ids come from [1000, 2000): ids every real vocabulary has as
# ordinary text tokens (past the specials and byte pieces at the start), as Dynamo's mocker draws.
SAFE_TOKEN_RANGE = (1000, 2000)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v not in (None, "") else default


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "play",
        help="be the engine of a real vLLM frontend (engine-core ZMQ protocol)",
        usage="%(prog)s [MODEL] [options]",
        description=(
            "Connect to a vLLM frontend started with external engines, e.g. "
            "`vllm serve MODEL --data-parallel-size-local 0 --data-parallel-address 127.0.0.1 "
            "--data-parallel-rpc-port 29550`, and serve its requests from simulated engines "
            "(as `vllm serve MODEL --headless` would)."),
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the served model's directory: output ids are drawn from its vocabulary (config.json, "
                        "tokenizer files), never its special tokens or EOS, and structured outputs follow its "
                        "tokenizer. Without it (and without --vocab-size) ids come from 1000-1999, which every "
                        "vocabulary has")
    w = p.add_argument_group("frontend connection")
    w.add_argument("--handshake-address", default=os.environ.get("MOCK_HANDSHAKE_ADDRESS", DEFAULT_HANDSHAKE),
                   help="the frontend's handshake socket, tcp://HOST:PORT (its --data-parallel-address "
                        "and --data-parallel-rpc-port) or ipc://PATH (default %(default)s)")
    w.add_argument("--handshake-timeout", type=float, default=300.0,
                   help="seconds to wait for the frontend's answer to HELLO (default %(default)s)")
    w.add_argument("--engine-id", default=os.environ.get("MOCK_ENGINE_ID") or uuid.uuid4().hex[:5],
                   help="instance_id reported to the frontend (rank i > 0 gets '-i' appended); default: "
                        "5 random hex digits, as vLLM's, so routers tell engines apart")
    w.add_argument("--vllm-version", default="0.33.0",
                   help="vllm_version in the ready payload (informational; default %(default)s)")
    w.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer directory: outputs then satisfy the requests' structured "
                        "outputs (json/regex/choice, and the structural tags tool parsers send)")
    w.add_argument("--dtype", default="bfloat16", help="dtype reported to the frontend (default %(default)s)")
    w.add_argument("--model-name", default=os.environ.get("MODEL", ""),
                   help="model name used in logs (the frontend serves its own --served-model-name)")
    w.add_argument("--max-loras", type=int, default=_env_int("MOCK_MAX_LORAS", 0),
                   help="max_loras reported to the frontend")
    s = p.add_argument_group("scheduler (reported to the frontend too)")
    s.add_argument("--max-model-len", type=int, default=_env_int("MOCK_MAX_MODEL_LEN", 0),
                   help="prompt+output limit; 0 = no arrival check, advertise 1048576 (the frontend "
                        "keeps the smaller of its own and ours)")
    s.add_argument("--max-num-seqs", type=int, default=_env_int("MOCK_MAX_NUM_SEQS", 128))
    s.add_argument("--max-num-batched-tokens", type=int, default=_env_int("MOCK_MAX_NUM_BATCHED_TOKENS", 2048))
    add_running_limit_args(s)
    s.add_argument("--block-size", type=int, default=None, help="alias of --tokens-per-block (vLLM's name)")
    s.add_argument("--min-step-time", type=float, metavar="MS",
                   default=_env_float("MOCK_MIN_STEP_TIME_MS", DEFAULT_MIN_STEP_TIME_MS),
                   help="the shortest a step takes, in ms (divided by --time-scale): steps start at least "
                        "this far apart, so at latency 0 each step's tokens reach the frontend as their own "
                        "output, as from a real GPU; 0 = back to back (default %(default)s)")
    add_engine_args(p)
    add_perf_args(p, vllm_gpu_flags=True)
    add_kv_events_args(p)  # vLLM's --kv-events-config / --enable-kv-cache-events
    return p


class ModelError(ValueError):
    """MODEL (or --tokenizer) cannot be read: the message names it."""


@dataclass
class Vocabulary:
    """What output ids may be: [0, vocab_size) without `textless_ids`; EOS as the engine's end token."""

    vocab_size: int
    eos_token_id: int | None
    textless_ids: frozenset[int]
    tokenizer: Any = None  # the model's Tokenizer, when it has tokenizer files
    source: str = ""


def model_vocabulary(model: str | None, tokenizer_dir: str | None, vocab_size: int | None) -> Vocabulary:
    """The vocabulary of MODEL's directory (its tokenizer files, else config.json's vocab_size and
    token ids), of --tokenizer, else SAFE_TOKEN_RANGE; --vocab-size overrides the size."""
    from ..frontend.model_config import read_hf_config
    from ..frontend.tokenizer import TokenizerError, load_tokenizer, ordinary_vocab_size

    for value, name in ((tokenizer_dir, "--tokenizer"), (model, "MODEL")):
        if not value:
            continue
        path = Path(value).expanduser()
        if not path.exists():
            raise ModelError(f"{name}: {value!r} does not exist (play reads the model directory, never downloads)")
        if path.is_dir() and (path / "tokenizer.json").is_file() or path.name == "tokenizer.json":
            try:
                tok = load_tokenizer(path)
            except (TokenizerError, OSError) as e:
                raise ModelError(f"{name}: {e}") from None
            size = vocab_size or ordinary_vocab_size(tok)
            return Vocabulary(size, tok.eos_token_id, tok.random_text_avoid(size), tok, f"{name} {value}")
        try:
            config = read_hf_config(path) if path.is_dir() else None
        except ValueError as e:
            raise ModelError(f"{name}: {e}") from None
        if config and config.get("vocab_size"):
            ids = [config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
            flat = {int(i) for v in ids for i in (v if isinstance(v, list) else [v]) if isinstance(i, int)}
            eos = config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
            return Vocabulary(vocab_size or int(config["vocab_size"]), eos, frozenset(flat),
                              source=f"{name} {value}/config.json")
        if name == "MODEL":
            raise ModelError(f"MODEL: {value!r} has neither tokenizer.json nor config.json")
    if vocab_size:
        return Vocabulary(vocab_size, None, frozenset(), source="--vocab-size")
    low, high = SAFE_TOKEN_RANGE
    return Vocabulary(high, None, frozenset(range(low)), source="")


def play_engine_args(args: argparse.Namespace, advertised_max_model_len: int,
                     vocabulary: Vocabulary | None = None) -> EngineArgs:
    """The engines' arguments from play's flags (ConfigError names a bad flag)."""
    extra: dict[str, Any] = {"model_name": args.model_name} if args.model_name else {}
    if vocabulary is not None:
        extra.update(vocab_size=vocabulary.vocab_size, eos_token_id=vocabulary.eos_token_id)
    eargs = engine_args_from_cli(args, advertised_max_model_len=advertised_max_model_len, engine_id=args.engine_id,
                                 min_step_time=args.min_step_time / 1000.0, **extra)
    if vocabulary is not None:
        eargs.vocab_size = vocabulary.vocab_size  # (not --vocab-size alone: MODEL's size, or the safe range)
    return eargs


def run(args: argparse.Namespace) -> int:
    from .handshake import UNLIMITED_MODEL_LEN, ReadyInfo
    from .server import PlayServer

    if args.block_size and args.tokens_per_block and args.block_size != args.tokens_per_block:
        print("error: --block-size and --tokens-per-block disagree", file=sys.stderr)
        return 2
    if args.engine_count < 1 or args.engine_count >= 1 << 16:
        print(f"error: --engine-count must be in [1, 65535], got {args.engine_count}", file=sys.stderr)
        return 2
    if not args.handshake_address.startswith(("tcp://", "ipc://")):
        print(f"error: --handshake-address must be tcp://HOST:PORT or ipc://PATH, got {args.handshake_address!r}",
              file=sys.stderr)
        return 2
    advertised = args.max_model_len if args.max_model_len > 0 else UNLIMITED_MODEL_LEN
    try:
        vocabulary = model_vocabulary(args.model_tag, args.tokenizer, args.vocab_size)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if vocabulary.source:
        log.info("output token ids from [0, %d) of %s (EOS %s, %d ids skipped: specials and byte pieces)",
                 vocabulary.vocab_size, vocabulary.source, vocabulary.eos_token_id, len(vocabulary.textless_ids))
    else:
        log.info("no MODEL or --vocab-size: output token ids are drawn from %d-%d, ids every vocabulary has "
                 "(give the served model's directory as MODEL to draw from its vocabulary)",
                 SAFE_TOKEN_RANGE[0], SAFE_TOKEN_RANGE[1] - 1)
    if not args.model_name and args.model_tag:
        args.model_name = args.model_tag
    try:
        eargs = play_engine_args(args, advertised, vocabulary)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        kv_events = kv_events_config_from_cli(args)
    except KVEventsConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ready = ReadyInfo(
        max_model_len=advertised,
        num_gpu_blocks=eargs.kv_cache_size,
        block_size=eargs.tokens_per_block,
        max_num_seqs=eargs.config.max_num_seqs,
        max_num_batched_tokens=eargs.config.max_num_batched_tokens,
        dtype=args.dtype,
        vllm_version=args.vllm_version,
        instance_id=args.engine_id,
        max_loras=args.max_loras,
    )
    factory = None
    if vocabulary.tokenizer is not None:  # MODEL's or --tokenizer's: structured outputs honoured
        from ..frontend.structured.engine_source import constrained_token_source

        factory = constrained_token_source(vocabulary.tokenizer, eargs.vocab_size)
    server = PlayServer(eargs, handshake_address=args.handshake_address, engine_count=args.engine_count,
                        ready=ready, handshake_timeout=args.handshake_timeout,
                        control_address=args.control_address,
                        control_token=getattr(args, "control_token", None), kv_events=kv_events, pd_args=args,
                        token_source_factory=factory, textless_ids=vocabulary.textless_ids)
    tune_for_serving()
    try:
        return event_loop.run(server.run())
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as e:  # e.g. the control address is malformed or taken
        print(f"error: {e}", file=sys.stderr)
        return 1
