"""The context length of a model, derived from its Hugging Face `config.json` as vLLM derives it.

vLLM (config/model.py `_get_and_verify_max_len`, 0.32) takes the smallest of a list of length keys
of the text config (`model_max_length`, when present, wins outright), applies the RoPE scaling
factor (except for the rope types whose `max_position_embeddings` is already scaled, and Gemma 3),
falls back to 2048 when no key is there, and refuses a `--max-model-len` above the derived value
unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set. `--disable-sliding-window` caps it at the window.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

from .sampling_defaults import SAMPLING_FIELDS, SamplingDefaults

logger = logging.getLogger("vllm_vcr.serve")

# vLLM's possible keys, in its order (the smallest value wins; the key named in errors is the
# first holding that smallest value)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
NO_KEY_DEFAULT = 2048  # vLLM's assumption when config.json names no length
DEFAULT_MAX_MODEL_LEN = 4096  # serve's context length when there is no config.json to derive it from
# rope types whose max_position_embeddings is already the scaled length
_PRESCALED_ROPE = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})


_LONG_WARNING = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative "
                 "position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model "
                 "uses absolute position encoding, positions exceeding derived_max_model_len will cause a CUDA "
                 "array out-of-bounds error.")


class ModelConfigError(ValueError):
    """The model's config.json is unreadable, or --max-model-len exceeds what it allows."""


def read_hf_config(model_dir: Path, name: str = "config.json") -> dict[str, Any] | None:
    """config.json (or another JSON object file) of a local model directory (None when it has none)."""
    path = model_dir / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return data


def generation_eos_ids(model_dir: Path | None, generation_config: str | None = "auto") -> tuple[int, ...]:
    """The end-of-sequence ids of the model's generation config, as vLLM reads them for every
    request (`--generation-config`: `auto` and `vllm` read MODEL's `generation_config.json`, a
    folder reads its own; without the file, `config.json`'s). Every one but the tokenizer's EOS
    becomes a stop token id of a request that does not ignore EOS (SamplingParams.
    update_from_generation_config); a Llama-3 instruct model ends its turns this way."""
    value = generation_config or "auto"
    folder = model_dir if value in ("auto", "vllm") else Path(value).expanduser()
    if folder is None or not folder.is_dir():
        return ()
    generation = read_hf_config(folder, "generation_config.json")
    if generation is not None:
        eos, source = generation.get("eos_token_id"), "generation_config.json"
    else:
        config = read_hf_config(folder) or {}
        eos, source = config.get("eos_token_id", text_config(config).get("eos_token_id")), "config.json"
    if eos is None or isinstance(eos, bool):
        return ()
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelConfigError(f"{folder / source}: eos_token_id must be an integer or a list of integers, "
                               f"got {eos!r}")
    return tuple(sorted(set(ids)))


def generation_defaults(model_dir: Path | None, generation_config: str | None = "auto",
                        override: dict[str, Any] | None = None) -> SamplingDefaults:
    """The server's default sampling values, as vLLM's ModelConfig.get_diff_sampling_param reads
    them: the generation config's sampling fields and `max_new_tokens` (`auto`: MODEL's
    `generation_config.json`; `vllm`: none; a folder: its own), `--override-generation-config`
    merged over them (a null value removes one). `max_new_tokens` is the default output limit,
    and a cap on every request when it comes from a folder or from the override."""
    value = generation_config or "auto"
    config: dict[str, Any] = {}
    if value != "vllm":
        folder = model_dir if value == "auto" else Path(value).expanduser()
        if folder is not None and folder.is_dir():
            config = read_hf_config(folder, "generation_config.json") or {}
    config = {**config, **(override or {})}
    for name in (*SAMPLING_FIELDS, "max_new_tokens"):
        v = config.get(name)
        if v is None:
            continue
        whole = name in ("top_k", "max_new_tokens")
        if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)) or \
                (name == "max_new_tokens" and v < 1):
            kind = "a positive integer" if name == "max_new_tokens" else "an integer" if whole else "a number"
            raise ModelConfigError(f"{name} must be {kind}, got {v!r}")
    values = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    default_max = config.get("max_new_tokens")
    cap = default_max if value not in ("auto", "vllm") else (override or {}).get("max_new_tokens")
    defaults = SamplingDefaults(values, default_max, cap)
    if defaults and value != "vllm":
        logger.warning("Default vLLM sampling parameters have been overridden by %s: `%s`. If this is not "
                       "intended, please relaunch vLLM instance with `--generation-config vllm`.",
                       "the model's `generation_config.json`" if value == "auto" else value, defaults.describe())
    return defaults


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config, as vLLM's hf_text_config."""
    sub = config.get("text_config")
    if isinstance(sub, dict):
        return {"model_type": config.get("model_type", ""), **sub}
    return config


def rope_parameters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The RoPE parameter sets (one per layer type when nested), legacy `rope_scaling` and `type`
    normalised as transformers' standardize_rope_params does."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        # transformers builds default parameters from rope_theta alone
        return [{"rope_type": "default"}] if config.get("rope_theta") is not None else []
    nested = all(isinstance(v, dict) for v in rope.values())
    sets = [v for v in rope.values() if v] if nested else [rope]
    out = []
    for rp in sets:
        rp = dict(rp)
        rp.setdefault("rope_type", rp.get("type", "default"))
        out.append(rp)
    return out


def derived_max_model_len(config: dict[str, Any]) -> tuple[float, str | None]:
    """(length, the key it came from) before RoPE scaling; inf when no key is there."""
    derived, key = float("inf"), None
    for k in LENGTH_KEYS:
        value = config.get(k)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < derived:
                key = k
            derived = min(derived, value)
    cohere = config.get("model_max_length")
    if cohere:
        derived, key = cohere, "model_max_length"
    return derived, key


def resolve_max_model_len(config: dict[str, Any], requested: int | None, *,
                          disable_sliding_window: bool = False) -> int:
    """vLLM's max_model_len for this config and the --max-model-len value (None or -1: derive)."""
    cfg = text_config(config)
    derived, key = derived_max_model_len(cfg)
    window = cfg.get("sliding_window")
    if disable_sliding_window and isinstance(window, int) and window < derived:
        derived, key = window, "sliding_window"
    if derived == float("inf"):
        if requested is not None and requested != -1:
            return requested
        logger.warning("The model's config.json does not contain any of the keys to determine the original "
                       "maximum length of the model. Assuming the model's maximum length is %d.", NO_KEY_DEFAULT)
        derived = NO_KEY_DEFAULT
    ropes = rope_parameters(cfg)
    if ropes and "gemma3" not in str(cfg.get("model_type", "")):
        factor = 1.0
        for rp in ropes:
            if rp["rope_type"] not in _PRESCALED_ROPE:
                factor = rp.get("factor", factor)
        derived *= 1.0 if factor is None else factor
    if requested is None or requested == -1:
        if any(rp["rope_type"] == "longrope" for rp in ropes):
            return int(cfg.get("original_max_position_embeddings", derived))
        return int(derived)
    if requested > derived:
        limit = cfg.get("model_max_length")
        if limit is None or requested > limit:
            msg = (f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
                   f"({key}={derived} or model_max_length={limit} in model's config.json).")
            if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
                logger.warning("%s %s", msg, _LONG_WARNING)
            else:
                raise ModelConfigError(f"{msg} To allow overriding this maximum, set the env var "
                                       f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {_LONG_WARNING}")
    return int(requested)


_REPO_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]+\b$")  # huggingface_hub's repo id rule


def check_model_path(model: str | None, hf_cache_dir: Callable[[str], Path | None]) -> Path | None:
    """MODEL as a local directory (or a snapshot in the HF cache), None for a bare model name; a
    path that does not exist is an error worded as vLLM's (huggingface_hub's) is."""
    if not model:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise ModelConfigError(f"Invalid repository ID or local directory specified: '{model}'. A local "
                                   "directory must contain a recognized configuration file ('config.json').")
        return path
    if path.exists():
        raise ModelConfigError(f"MODEL: {model!r} is a file, not a model directory")
    if model.count("/") > 1:
        raise ModelConfigError(f"MODEL: no such directory, and not a model id: Repo id must be in the form "
                               f"'repo_name' or 'namespace/repo_name': '{model}'. Use `repo_type` argument if needed.")
    if not _REPO_ID.match(model) or "--" in model or ".." in model or len(model) > 96:
        raise ModelConfigError(f"MODEL: no such directory, and not a model id: Repo id must use alphanumeric "
                               f"chars, '-', '_' or '.'. The name cannot start or end with '-' or '.' and the "
                               f"maximum length is 96: '{model}'.")
    return hf_cache_dir(model)


def max_model_len_for(requested: int | None, model_dir: Path | None, default: int, *,
                      disable_sliding_window: bool = False) -> int:
    """--max-model-len, or the length vLLM derives from MODEL's config.json (else `default`)."""
    if requested is not None and requested != -1 and requested < 1:
        raise ModelConfigError(f"--max-model-len must be >= 1 (or -1), got {requested}")
    config = read_hf_config(model_dir) if model_dir is not None else None
    if config is None:
        return default if requested in (None, -1) else requested
    try:
        return resolve_max_model_len(config, requested, disable_sliding_window=disable_sliding_window)
    except ModelConfigError as e:
        raise ModelConfigError(f"--max-model-len: {e}") from None


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


def kv_bytes_per_token(config: dict[str, Any], kv_cache_dtype: str | None = None) -> int | None:
    """Bytes one token's keys and values take in a full-attention KV cache: 2 x layers x KV heads
    x head size x element size (the element from --kv-cache-dtype, else the model's dtype).
    None when config.json lacks the shapes."""
    c = text_config(config)
    try:
        layers = int(c["num_hidden_layers"])
        heads = int(c.get("num_attention_heads") or 0)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or (int(c["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    dtype = kv_cache_dtype if kv_cache_dtype and kv_cache_dtype != "auto" else str(
        c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or "bfloat16")
    size = 1 if dtype.startswith("fp8") else _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)
    total = 2 * layers * kv_heads * head_dim * size
    return total if total > 0 else None
