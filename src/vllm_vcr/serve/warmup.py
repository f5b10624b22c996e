"""Start-up warm-up: a chat stream and a completion stream through a throwaway engine and app
before `serve` listens, so that the first requests do not pay for first-use work (imports done
inside functions, tables built on first use, the first calls into the tokenizer, the chat
template and the renderers): about 5-7 ms for the first request of a cold process against 1-2 ms
after. vLLM, too, runs its model once (profile and warm-up runs) before it reports ready.

The throwaway engine and app have their own stats and their own metrics registry, and the
requests never reach the server's engines, KV events or fault gate: nothing of the warm-up is
counted or seen from outside.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from ..engine.async_engine import AsyncEngine
from ..engine.config import EngineArgs, EngineConfig
from ..frontend.structured.schemas import check_schema
from ..frontend.tokenizer import Tokenizer
from ..http.serving_base import ServeSettings
from .app import build_app

logger = logging.getLogger("vllm_vcr.serve")
WARM_UP_BLOCKS = 256
TIMEOUT = 10.0  # s: a warm-up that takes longer is abandoned (the server starts anyway)
_PROMPT = "Warm-up: the first request pays for what later ones find ready. " * 4
_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def throwaway_args(args: EngineArgs) -> EngineArgs:
    """The server's engine, without latency, recorded inputs, loading time or failures."""
    config = EngineConfig(max_model_len=args.config.max_model_len, log_requests=False)
    # a small KV cache: the warm-up prompts need a few blocks, and a pool as large as the
    # server's (65,536 blocks in the benchmarks) would leave its memory to the process
    return EngineArgs(config=config, kv_cache_size=min(args.kv_cache_size, WARM_UP_BLOCKS),
                      tokens_per_block=args.tokens_per_block,
                      vocab_size=args.vocab_size, eos_token_id=args.eos_token_id, mode=args.mode,
                      advertised_max_model_len=args.advertised_max_model_len, model_name=args.model_name,
                      engine_type=args.engine_type, reasoning=args.reasoning).validate()


def warm_up_requests(settings: ServeSettings) -> list[tuple[str, dict[str, Any]]]:
    model = settings.model_name
    usage = {"include_usage": True}
    return [
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": _PROMPT}],
                                  "max_tokens": 3, "stream": True, "stream_options": usage}),
        ("/v1/completions", {"model": model, "prompt": _PROMPT, "max_tokens": 3, "stream": True,
                             "stream_options": usage}),
    ]


async def warm_up(engine_args: EngineArgs, tokenizer: Tokenizer, settings: ServeSettings) -> float:
    """Run the warm-up requests; returns how long it took (s). Never raises: a failed warm-up
    is logged and the server starts as it would have without it."""
    t0 = time.perf_counter()
    engine = AsyncEngine(throwaway_args(engine_args))
    try:
        await engine.start()
        app = build_app(engine, tokenizer, settings)
        for path, body in warm_up_requests(settings):
            status = await asyncio.wait_for(_call(app, path, body, settings), TIMEOUT)
            if status != 200:  # e.g. a --max-model-len too short for its prompt: still warmed the parsing
                logger.debug("warm-up request %s answered %s", path, status)
        # A request's JSON schema is checked on the loop, and the first check imports jsonschema
        # (~40 ms of CPU). Only the check: the structured output itself is generated off the loop.
        check_schema(_SCHEMA)
    except Exception as e:  # noqa: BLE001 - the warm-up must never keep the server from starting
        logger.warning("warm-up failed (the first requests may be slower): %s", e)
    finally:
        await engine.stop(0)
    return time.perf_counter() - t0


async def _call(app: Any, path: str, body: dict[str, Any], settings: ServeSettings) -> int:
    """One request through the ASGI app, in process (httpx's ASGI transport); returns its status."""
    headers = {"authorization": f"Bearer {settings.api_keys[0]}"} if settings.api_keys else {}
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 0))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.post(path, json=body, headers=headers)
    return response.status_code
