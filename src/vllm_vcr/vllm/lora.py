"""LoRA adapters in `serve`: vLLM's flags, its adapter registry and its load/unload routes.

vLLM's frontend keeps a registry of adapters by name (`OpenAIServingModels`): `--lora-modules`
loads the static ones at start-up, `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`
(only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) change it at run time, `/v1/models` lists each
adapter with `parent` = its base model and `root` = its path, and a request whose `model` names
an adapter runs with that adapter's `LoRARequest`. Loading validates the adapter as vLLM's
worker does before any weight is read: `adapter_config.json` must exist (else 404 "No adapter
found"), its rank must fit `--max-lora-rank` and it must not use unsupported features (else
500 with the engine's "Call to add_lora method failed: ..." text). There are no weights here, so
the weight files themselves are not required.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from ..engine.types import LoRARequest
from ..frontend.errors import HTTPError, sanitize

logger = logging.getLogger("vllm_vcr.vllm.lora")

@dataclass
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


@dataclass
class LoRAConfig:
    enabled: bool = False
    modules: list[LoRAModulePath] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    load_time_ms: float = 0.0
    swap_in_time_ms: float = 0.0
    runtime_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING

    @classmethod
    def from_cli(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> "LoRAConfig":
        """Validated as vLLM's LoRAConfig does; ValueError names the flag."""
        env = os.environ if environ is None else environ
        enabled = bool(getattr(args, "enable_lora", False))
        modules = list(getattr(args, "lora_modules", None) or [])
        max_loras = int(getattr(args, "max_loras", 1) or 1)
        max_cpu = getattr(args, "max_cpu_loras", None)
        if modules and not enabled:
            raise ValueError("--lora-modules needs --enable-lora (vLLM cannot load adapters without it)")
        if max_cpu is None:
            max_cpu = max_loras
        elif max_cpu < max_loras:
            raise ValueError(f"--max-cpu-loras: max_cpu_loras ({max_cpu}) must be >= max_loras ({max_loras}).")
        load_time = float(getattr(args, "lora_load_time", 0.0) or 0.0)
        swap_in_time = float(getattr(args, "lora_swap_in_time", 0.0) or 0.0)
        for flag, v in (("--lora-load-time", load_time), ("--lora-swap-in-time", swap_in_time)):
            if v < 0:
                raise ValueError(f"{flag} must be >= 0, got {v}")
        return cls(enabled=enabled, modules=modules, max_loras=max_loras,
                   max_lora_rank=int(getattr(args, "max_lora_rank", 16) or 16), max_cpu_loras=int(max_cpu),
                   load_time_ms=load_time, swap_in_time_ms=swap_in_time,
                   runtime_updating=env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
                   in ("1", "true"))


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _adapter_dir(path: str) -> str:
    """vLLM's get_adapter_absolute_path, without the Hub download (vllm-vcr never downloads)."""
    if os.path.isabs(path):
        return path
    if path.startswith("~"):
        return os.path.expanduser(path)
    return os.path.abspath(path) if os.path.exists(path) else path


def check_adapter(lora: LoRARequest, max_lora_rank: int) -> None:
    """What vLLM's worker checks before reading weights; HTTPError as the frontend reports it."""
    config_path = os.path.join(_adapter_dir(lora.lora_path), "adapter_config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _user_error(404, f"Loading lora {lora.lora_name} failed: No adapter found for {lora.lora_path}",
                          "NotFoundError") from None
    except (OSError, ValueError) as e:
        raise _add_lora_failed(f"{type(e).__name__}: {e}") from None
    problems = []
    if config.get("use_dora"):
        problems.append("vLLM does not yet support DoRA.")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    try:
        rank = max(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise _add_lora_failed(f"invalid rank in adapter_config.json: {ranks!r}") from None
    if rank > max_lora_rank:
        problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    if problems:
        raise _add_lora_failed(" ".join(problems))


def _user_error(status: int, message: str, err_type: str = "InvalidUserInput") -> HTTPError:
    return HTTPError(status, sanitize(message), err_type)  # vLLM hides server paths in every message


def _add_lora_failed(message: str) -> HTTPError:
    return HTTPError(500, sanitize(f"Call to add_lora method failed: {message}"), "InternalServerError")


class LoRAAdapters:
    """The frontend's adapter registry (vLLM's OpenAIServingModels.lora_requests)."""

    def __init__(self, config: LoRAConfig, base_model_names: list[str]):
        self.config = config
        self.base_model_names = list(base_model_names)
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str | None] = {}
        self._next_id = 0

    def load_static(self) -> None:
        """--lora-modules, at start-up: any failure stops the server (vLLM raises)."""
        for m in self.config.modules:
            base = m.base_model_name if m.base_model_name in self.base_model_names else None
            try:
                self.load(LoadLoRAAdapterRequest(lora_name=m.name, lora_path=m.path,
                                                 is_3d_lora_weight=m.is_3d_lora_weight), base)
            except HTTPError as e:
                raise ValueError(f"--lora-modules: {e.message}") from None

    def load(self, req: LoadLoRAAdapterRequest, base_model_name: str | None = None) -> str:
        name = req.lora_name
        if not name or not req.lora_path:
            raise _user_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.base_model_names:
            raise _user_error(400, f"The lora adapter '{name}' conflicts with a served base model.",
                            "InvalidUserInput")
        if not req.load_inplace and name in self.requests:
            raise _user_error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                 "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        previous = self.requests.get(name)
        if previous is not None:
            lora_id = previous.lora_int_id
        else:
            self._next_id += 1
            lora_id = self._next_id
        lora = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=req.lora_path)
        if not self.config.enabled:
            raise _add_lora_failed("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        check_adapter(lora, self.config.max_lora_rank)
        self.requests[name] = lora
        self.parents[name] = base_model_name
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, req.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        name = req.lora_name
        if not name:
            raise _user_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.requests:
            raise _user_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.requests[name]
        self.parents.pop(name, None)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def get(self, model: str | None) -> LoRARequest | None:
        return self.requests.get(model) if model else None

    def model_cards(self, now: int, permission: dict[str, Any]) -> list[dict[str, Any]]:
        """vLLM's ModelCard per adapter: root = path, parent = base model, no max_model_len."""
        return [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": lora.lora_path,
                 "parent": self.parents.get(name) or self.base_model_names[0], "max_model_len": None,
                 "permission": [permission]}
                for name, lora in self.requests.items()]
