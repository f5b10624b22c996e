"""What `vllm-vcr serve`'s command line says, validated: the tokenizer (a local directory or the
local Hugging Face cache, never downloaded), the chat template, the engine arguments and the
frontend's settings. Every error is a CLIError that names its flag."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..engine.config import ConfigError, EngineArgs
from ..engine_cli import engine_args_from_cli
from ..frontend.model_config import (DEFAULT_MAX_MODEL_LEN, ModelConfigError, check_model_path, generation_defaults,
                                      generation_eos_ids, max_model_len_for)
from ..frontend.tokenizer import DEFAULT_MODEL_NAME, Tokenizer, TokenizerError, load_tokenizer, ordinary_vocab_size
from ..frontend.tools.calls import TOOL_CALL_PARSERS, ToolSettings
from ..http.serving_base import VLLM_API_VERSION, ServeSettings
from .ignored_flags import ignored_flags

logger = logging.getLogger("vllm_vcr.serve")

INLINE_TEMPLATE_CHARS = "{}\n"  # vLLM's JINJA_CHARS: such a value is a template, not a path


class CLIError(Exception):
    """A bad flag value: printed as `vllm-vcr serve: error: ...`, exit status 2."""


def cached_model_dir(repo_id: str, cache_dir: str | Path | None = None) -> Path | None:
    """The snapshot of `repo_id` in the local Hugging Face cache that holds a tokenizer.json
    (read only: vllm-vcr never downloads)."""
    if "/" not in repo_id or repo_id.startswith((".", "/")):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "tokenizer.json", cache_dir=cache_dir)
    except ValueError:  # not a valid repo id (HFValidationError)
        return None
    return Path(found).parent if isinstance(found, str) else None


def resolve_tokenizer(model: str | None, tokenizer: str | None) -> Tokenizer:
    """--tokenizer, else MODEL when it holds tokenizer files, else the embedded tokenizer."""
    for value, flag in ((tokenizer, "--tokenizer"), (model, "MODEL")):
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_dir() or path.is_file():
            if (path / "tokenizer.json").is_file() or path.name == "tokenizer.json":
                try:
                    return load_tokenizer(path)
                except TokenizerError as e:
                    raise CLIError(f"{flag}: {e}") from None
            if flag == "--tokenizer":
                raise CLIError(f"--tokenizer: no tokenizer.json in {value!r}")
            continue  # a model directory without tokenizer files: fall through
        if flag == "--tokenizer" and (value.startswith((".", "/", "~")) or os.sep in value and "/" not in value):
            raise CLIError(f"--tokenizer: {value!r} does not exist")
        cached = cached_model_dir(value)
        if cached is not None:
            try:
                return load_tokenizer(cached)
            except TokenizerError as e:
                raise CLIError(f"{flag}: {e}") from None
        if flag == "--tokenizer":
            logger.warning("--tokenizer %s is not a local directory and not in the HF cache; vllm-vcr never "
                           "downloads, using the embedded tokenizer", value)
    return load_tokenizer(None)


def _chat_template_source(value: str | None) -> str | None:
    """--chat-template: a file, else an inline template; like vLLM, a value with a jinja character
    (`{`, `}` or a newline) is a template, any other value is a path that must exist."""
    if not value:
        return None
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except OSError as e:
        if any(c in value for c in INLINE_TEMPLATE_CHARS):
            return value
        raise CLIError(f"--chat-template: {value!r} looks like a file path, but it cannot be read: "
                       f"{e.strerror or e}") from None


def _tokenizer(model: str | None, tokenizer: str | None, template: str | None, workers: int) -> Tokenizer:
    tok = resolve_tokenizer(model, tokenizer)
    tok.use_worker_threads(workers)
    if template is not None:
        from ..frontend.chat_template import ChatTemplate, ChatTemplateError

        try:
            tok.chat_template = ChatTemplate(template)
        except ChatTemplateError as e:
            raise CLIError(f"--chat-template: {e}") from None
    return tok


def build_settings_and_args(args: argparse.Namespace, tokenizers: dict | None = None,
                            ) -> tuple[ServeSettings, EngineArgs, Tokenizer, int, list[str]]:
    """Validate everything the command line says; CLIError names the flag. `tokenizers` (a dict
    the caller keeps) shares one tokenizer, its caches and chat template among the servers of a
    process that load the same files with the same template."""
    model = args.model_opt or args.model_tag
    if args.model_opt and args.model_tag and args.model_opt != args.model_tag:
        raise CLIError(f"MODEL {args.model_tag!r} and --model {args.model_opt!r} disagree")
    names = args.served_model_name or [model or DEFAULT_MODEL_NAME]
    if any(not n for n in names):
        raise CLIError("--served-model-name: names must not be empty")
    try:
        model_dir = check_model_path(model, cached_model_dir)
        max_model_len = max_model_len_for(args.max_model_len, model_dir, DEFAULT_MAX_MODEL_LEN,
                                          disable_sliding_window=bool(getattr(args, "disable_sliding_window", False)))
    except ModelConfigError as e:
        raise CLIError(str(e)) from None
    args.max_model_len = max_model_len  # the engine's arrival check uses it too
    source = str(model_dir) if model_dir is not None else model
    template = _chat_template_source(args.chat_template)
    workers = int(getattr(args, "renderer_num_workers", 1) or 1)
    generation_config = getattr(args, "generation_config", None) or "auto"
    try:
        gen_eos = generation_eos_ids(model_dir, generation_config)
    except ModelConfigError as e:
        raise CLIError(f"--generation-config: {e}") from None
    template_kwargs = getattr(args, "default_chat_template_kwargs", None) or {}
    if not isinstance(template_kwargs, dict):
        raise CLIError(f"--default-chat-template-kwargs: must be a JSON object, got {template_kwargs!r}")
    override = getattr(args, "override_generation_config", None) or {}
    if not isinstance(override, dict):
        raise CLIError(f"--override-generation-config: must be a JSON object, got {override!r}")
    try:
        sampling_defaults = generation_defaults(model_dir, generation_config, override)
    except ModelConfigError as e:
        flag = "--override-generation-config" if any(str(e).startswith(k + " ") for k in override) \
            else "--generation-config"
        raise CLIError(f"{flag}: {e}") from None
    key = (source, args.tokenizer, template, workers, gen_eos)
    tok = tokenizers.get(key) if tokenizers is not None else None
    if tok is None:
        tok = _tokenizer(source, args.tokenizer, template, workers)
        tok.generation_eos_ids = tuple(i for i in gen_eos if i != tok.eos_token_id)
        if tokenizers is not None:
            tokenizers[key] = tok
    engine_count = args.engine_count
    if args.data_parallel_size is not None and engine_count == 1:
        engine_count = args.data_parallel_size
    if engine_count < 1:
        raise CLIError(f"--engine-count must be >= 1, got {engine_count}")
    if getattr(args, "enable_log_requests", None) is not None:  # vLLM's name of --log-requests
        args.log_requests = bool(args.enable_log_requests)
    check_ranges(args)
    eos = tok.eos_token_id
    try:
        engine_args = engine_args_from_cli(
            args,
            advertised_max_model_len=max_model_len,
            model_name=names[0],
            vocab_size=ordinary_vocab_size(tok),
            eos_token_id=eos,
        )
    except ConfigError as e:
        raise CLIError(str(e)) from None
    except (TypeError, ValueError) as e:  # e.g. a MOCK_* environment variable that is not a number
        raise CLIError(str(e)) from None
    # vLLM flags the engine honours, when the engine's own parser did not take them already
    if getattr(args, "enable_prefix_caching", None) is not None:
        engine_args.enable_prefix_caching = bool(args.enable_prefix_caching)
    if getattr(args, "enable_chunked_prefill", None) is not None:
        engine_args.enable_chunked_prefill = bool(args.enable_chunked_prefill)
    if getattr(args, "prefix_caching_hash_algo", None) is not None:
        engine_args.prefix_caching_hash_algo = args.prefix_caching_hash_algo
    _kv_cache_from_bytes(args, engine_args, model_dir)
    # zero-latency bursts only where they are invisible: SSE events of N tokens anyway
    engine_args.max_burst = max(1, int(getattr(args, "stream_interval", 1) or 1))
    try:
        engine_args.validate()
    except ConfigError as e:
        raise CLIError(str(e)) from None
    reasoning_parser = getattr(args, "reasoning_parser", None) or None
    reasoning_ids = None
    if reasoning_parser and engine_args.reasoning:
        from ..engine.tokens import ReasoningConfig

        try:
            rc = ReasoningConfig.parse(engine_args.reasoning)
        except ValueError as e:
            raise CLIError(str(e)) from None
        reasoning_ids = (rc.start_id, rc.end_id)
    elif reasoning_parser:
        logger.info("--reasoning-parser without --reasoning: outputs have no thinking span to split")
    # vLLM: --api-key wins over VLLM_API_KEY, then empty keys are dropped (`--api-key ""` turns auth off)
    keys = [k for k in (list(args.api_key or []) or _env_api_key()) if k]
    fingerprint = _fingerprint(args, names[0], max_model_len, engine_args)
    settings = ServeSettings(
        served_model_names=list(names),
        model_root=model or names[0],
        max_model_len=max_model_len,
        engine_count=engine_count,
        api_keys=keys,
        scheduling_policy=engine_args.scheduling_policy,
        response_role=args.response_role,
        vocab_limit=max(tok.vocab_size, engine_args.vocab_size),
        force_include_usage=bool(args.enable_force_include_usage),
        prompt_tokens_details=bool(getattr(args, "enable_prompt_tokens_details", False)),
        reasoning_parser=reasoning_parser,
        reasoning_ids=reasoning_ids,
        tools=_tool_settings(args),
        scale_out=bool(getattr(args, "enable_scale_out", False) or getattr(args, "tokens_only", False)),
        engine_type=engine_args.engine_type,
        worker_type=engine_args.worker_type,
        system_fingerprint=fingerprint,
        block_size=engine_args.tokens_per_block,
        num_gpu_blocks=engine_args.kv_cache_size,
        enable_prefix_caching=engine_args.enable_prefix_caching,
        trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
        request_id_headers=bool(getattr(args, "enable_request_id_headers", False)),
        allowed_origins=list(getattr(args, "allowed_origins", None) or []),
        allowed_methods=list(getattr(args, "allowed_methods", None) or ["*"]),
        allowed_headers=list(getattr(args, "allowed_headers", None) or ["*"]),
        allow_credentials=bool(getattr(args, "allow_credentials", False)),
        stream_interval=int(getattr(args, "stream_interval", 1) or 1),
        per_request_metrics=bool(getattr(args, "enable_per_request_metrics", False)),
        sse_keep_alive_interval=float(getattr(args, "sse_keep_alive_interval", 0) or 0),
        max_num_queued_reqs=getattr(args, "max_num_queued_reqs", None),
        max_num_queued_tokens=getattr(args, "max_num_queued_tokens", None),
        data_parallel_rank=int(getattr(args, "data_parallel_rank", None) or 0),
        sampling_defaults=sampling_defaults,
        default_chat_template_kwargs=dict(template_kwargs),
        return_tokens_as_token_ids=bool(getattr(args, "return_tokens_as_token_ids", False)),
        exclude_tools_when_tool_choice_none=bool(getattr(args, "exclude_tools_when_tool_choice_none", False)),
        chat_template_content_format=getattr(args, "chat_template_content_format", None) or "auto",
    )
    return settings, engine_args, tok, engine_count, ignored_flags(args)


# vLLM's types accept any int for these; values the simulator cannot run with fail here, naming the flag
_AT_LEAST = {"sse_keep_alive_interval": 0, "port": 0, "max_num_seqs": 1, "max_num_batched_tokens": 1, "block_size": 1,
             "stream_interval": 1, "renderer_num_workers": 1, "max_num_queued_reqs": 0, "max_num_queued_tokens": 0,
             "data_parallel_rank": 0, "data_parallel_size": 1,
             "kv_cache_memory_bytes": 1}


def check_ranges(args: argparse.Namespace) -> None:
    """Values vLLM's types accept and the simulator cannot run with: CLIError naming the flag."""
    for dest, lo in _AT_LEAST.items():
        value = getattr(args, dest, None)
        if value is not None and value < lo:
            raise CLIError(f"--{dest.replace('_', '-')}: must be >= {lo}, got {value}")
    if (getattr(args, "port", 0) or 0) > 65535:
        raise CLIError(f"--port: must be in [0, 65535], got {args.port}")


def _kv_cache_from_bytes(args: argparse.Namespace, engine_args: EngineArgs, model_dir: Path | None) -> None:
    """--kv-cache-memory-bytes: the KV cache holds bytes / (block size x KV bytes per token) blocks,
    the bytes per token from the model's config.json (else --kv-bytes-per-token); as in vLLM,
    --num-gpu-blocks-override wins."""
    total = getattr(args, "kv_cache_memory_bytes", None)
    if total is None or getattr(args, "num_gpu_blocks_override", None) is not None:
        return
    from ..frontend.model_config import kv_bytes_per_token, read_hf_config

    config = read_hf_config(model_dir) if model_dir is not None else None
    dtype = getattr(args, "kv_cache_dtype", None) or getattr(args, "ignored__kv_cache_dtype", None)
    per_token = (kv_bytes_per_token(config, dtype) if config else None) or engine_args.kv_bytes_per_token
    per_block = per_token * engine_args.tokens_per_block
    blocks = total // per_block
    if blocks < 1:
        raise CLIError(f"--kv-cache-memory-bytes {total} holds no KV block of {per_block} bytes "
                       f"({engine_args.tokens_per_block} tokens x {per_token} bytes)")
    engine_args.kv_cache_size = blocks
    logger.info("KV cache: %d blocks of %d tokens from --kv-cache-memory-bytes %d (%d bytes per token)",
                blocks, engine_args.tokens_per_block, total, per_token)


def _tool_settings(args: argparse.Namespace) -> ToolSettings:
    enable = bool(getattr(args, "enable_auto_tool_choice", False))
    parser = getattr(args, "tool_call_parser", None)
    if enable and parser is None:
        raise CLIError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise CLIError(f"--tool-call-parser: invalid tool call parser: {parser} (vllm-vcr simulates "
                       f"{', '.join(TOOL_CALL_PARSERS)})")
    return ToolSettings(parser, enable, getattr(args, "auto_tool_call_probability", 1.0))


def _fingerprint(args: argparse.Namespace, model: str, max_model_len: int, engine_args: EngineArgs) -> str | None:
    """vLLM's system_fingerprint: vllm-<version>-<8 hex of the configuration>."""
    mode = getattr(args, "fingerprint_mode", "full") or "full"
    if mode == "none":
        return None
    if mode == "custom":
        if not getattr(args, "fingerprint_value", None):
            raise CLIError("--fingerprint-value is required with --fingerprint-mode custom")
        return args.fingerprint_value
    import hashlib

    import msgspec

    digest = hashlib.sha256(msgspec.json.encode([model, max_model_len, engine_args])).hexdigest()[:8]
    return f"vllm-{VLLM_API_VERSION}-{digest}"


def _env_api_key() -> list[str]:
    key = os.environ.get("VLLM_API_KEY")
    return [key] if key else []
