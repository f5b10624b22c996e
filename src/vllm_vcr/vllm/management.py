"""Operator endpoints of vLLM 0.32's frontend: LoRA load/unload, the dev-mode routes (sleep,
pause, caches, server info) and elastic EP scaling, with vLLM's bodies and errors.

The handlers; which of them exist (env `VLLM_SERVER_DEV_MODE`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING`,
the generate/pooling runner) is declared in vllm/routes.py, as vLLM's `register_api_routers` decides.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, is_dataclass
from http import HTTPStatus
from typing import Any

import msgspec

from ..frontend.errors import HTTPError, validation_error
from ..http.serving_base import VLLM_API_VERSION, RequestContext, encode, parse_request, raw_request_json
from ..http.sse import send_bytes
from .lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .sleep import parse_sleep_query, query_params

_TEXT = b"text/plain; charset=utf-8"


def http_exception(status: int, detail: str) -> HTTPError:
    """FastAPI's HTTPException as vLLM's handler renders it (type = the status phrase)."""
    return HTTPError(status, detail, HTTPStatus(status).phrase)


def _bool_query(ctx: RequestContext, name: str, default: bool) -> bool:
    values = query_params(ctx.scope).get(name)
    if not values:
        return default
    raw = values[-1].strip().lower()
    if raw in ("1", "true", "t", "yes", "y", "on"):
        return True
    if raw in ("0", "false", "f", "no", "n", "off"):
        return False
    raise validation_error([{"type": "bool_parsing", "loc": (name,),
                             "msg": "Input should be a valid boolean, unable to interpret input",
                             "input": values[-1]}], where="query")


class Management:
    """The handlers; state lives in the app (engine, LoRA registry, sleep control)."""

    def __init__(self, app: Any, ext: Any):  # the serve app and its ServeExtensions
        self.app = app
        self.ext = ext

    # -- LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING) --------------------------------------------------
    async def load_lora_adapter(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, LoadLoRAAdapterRequest)
        msg = self.ext.adapters.load(req)
        await send_bytes(ctx.send, 200, msg.encode(), content_type=_TEXT)

    async def unload_lora_adapter(self, ctx: RequestContext) -> None:
        req = parse_request(ctx.body, UnloadLoRAAdapterRequest)
        msg = self.ext.adapters.unload(req)
        await send_bytes(ctx.send, 200, msg.encode(), content_type=_TEXT)

    # -- sleep / pause (dev mode) -----------------------------------------------------------------
    async def sleep(self, ctx: RequestContext) -> None:
        q = parse_sleep_query(ctx.scope)
        await self.ext.sleep_control.sleep(q.level, q.mode)
        await send_bytes(ctx.send, 200, encode({"status": "sleeping", "level": q.level}))

    async def wake_up(self, ctx: RequestContext) -> None:
        tags = query_params(ctx.scope).get("tags") or None
        fully_awake = await self.ext.sleep_control.wake_up(tags)
        await send_bytes(ctx.send, 200, encode({"status": "awake" if fully_awake else "sleeping", "tags": tags}))

    async def is_sleeping(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, encode({"is_sleeping": await self.ext.sleep_control.is_sleeping()}))

    async def pause(self, ctx: RequestContext) -> None:
        q = parse_sleep_query(ctx.scope)  # mode is validated the same way as /sleep's
        await self.ext.sleep_control.pause(q.mode, _bool_query(ctx, "clear_cache", True))
        await send_bytes(ctx.send, 200, encode({"status": "paused"}))

    async def resume(self, ctx: RequestContext) -> None:
        await self.ext.sleep_control.resume()
        await send_bytes(ctx.send, 200, encode({"status": "resumed"}))

    async def release_kv_cache_memory(self, ctx: RequestContext) -> None:
        try:
            await self.ext.sleep_control.release_kv_cache_memory()
        except RuntimeError as e:  # the engine core's refusal, as vLLM's utility call reports it: a 500
            raise HTTPError(500, f"Call to release_kv_cache_memory method failed: {e}", "InternalServerError") from None
        await send_bytes(ctx.send, 200, encode({"status": "kv_cache_released"}))

    async def load(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, encode({"server_load": self.ext.server_load}))

    async def is_paused(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, encode({"is_paused": await self.ext.sleep_control.is_paused()}))

    # -- caches and server info (dev mode) --------------------------------------------------------
    async def reset_prefix_cache(self, ctx: RequestContext) -> None:
        _bool_query(ctx, "reset_running_requests", False)
        _bool_query(ctx, "reset_external", False)
        results = await self.app.engine.reset_prefix_cache()
        await send_bytes(ctx.send, 200, encode({"success": all(results)}))

    async def reset_nothing(self, ctx: RequestContext) -> None:
        """/reset_mm_cache and /reset_encoder_cache: no multimodal or encoder cache here (vLLM: 200, no body)."""
        await send_bytes(ctx.send, 200, b"", content_type=b"application/json")

    async def server_info(self, ctx: RequestContext) -> None:
        values = query_params(ctx.scope).get("config_format")
        fmt = values[-1] if values else "text"
        if fmt not in ("text", "json"):
            raise validation_error([{"type": "literal_error", "loc": ("config_format",),
                                     "msg": "Input should be 'text' or 'json'", "input": fmt,
                                     "ctx": {"expected": "'text' or 'json'"}}], where="query")
        config = self.ext.server_config(self.app)
        body = {"vllm_config": _config_text(config) if fmt == "text" else config,
                "vllm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and "KEY" not in k},
                "system_env": _system_env()}
        await send_bytes(ctx.send, 200, encode(body))

    # -- elastic EP (generate runner) -------------------------------------------------------------
    async def scale_elastic_ep(self, ctx: RequestContext) -> None:
        body = raw_request_json(ctx.body, lambda e: http_exception(400, "Invalid JSON format"))
        if not isinstance(body, dict):
            # vLLM calls body.get on it: its catch-all handler answers with the AttributeError
            raise HTTPError(500, f"'{type(body).__name__}' object has no attribute 'get'", "InternalServerError")
        size = body.get("new_data_parallel_size")
        drain = body.get("drain_timeout", 120)
        if size is None:
            raise http_exception(400, "new_data_parallel_size is required")
        # (vLLM's isinstance(..., int) checks: a JSON true is the integer 1 to them)
        if not isinstance(size, int) or size <= 0:
            raise http_exception(400, "new_data_parallel_size must be a positive integer")
        if not isinstance(drain, int) or drain <= 0:
            raise http_exception(400, "drain_timeout must be a positive integer")
        if size != self.app.settings.engine_count:
            # vLLM scales only with the Ray DP backend; anything else fails in the engine client
            raise http_exception(500, "Scale failed")
        await send_bytes(ctx.send, 200, encode({"message": f"Scaled to {size} data parallel engines"}))

    async def is_scaling_elastic_ep(self, ctx: RequestContext) -> None:
        await send_bytes(ctx.send, 200, encode({"is_scaling_elastic_ep": False}))


def _config_text(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _system_env() -> dict[str, Any]:
    return {"os": platform.platform(), "python_version": sys.version.split()[0], "is_cuda_available": False,
            "cuda_runtime_version": None, "gpu_models_and_configuration": None,
            "vllm_version": VLLM_API_VERSION, "simulator": "vllm-vcr", "cpu_count": os.cpu_count()}


def plain(obj: Any) -> Any:
    """A config object as JSON-able data (dataclasses and msgspec structs)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: plain(v) for k, v in asdict(obj).items()}
    if isinstance(obj, msgspec.Struct):
        return msgspec.to_builtins(obj, enc_hook=str)
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else str(obj)
