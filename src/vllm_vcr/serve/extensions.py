"""What `serve` adds to the OpenAI app beyond generation: LoRA adapters, sleep/pause, the
operator endpoints and the pooling runner. Built from the command line by `from_cli`; the app
calls `wrap_engine` before its services exist, and the route tables read the flags (serve/routes.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ..engine.types import EngineCoreOutput, EngineCoreRequest
from ..openai.pooling import PoolingConfig
from ..vllm.lora import LoRAAdapters, LoRAConfig
from ..vllm.lora_metrics import LoRARequestStates
from ..vllm.sleep import SleepConfig, SleepControl


def env_flag(environ: Any, name: str) -> bool:
    return str(environ.get(name, "0")).strip().lower() in ("1", "true")


@dataclass
class ServeExtensions:
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sleep: SleepConfig = field(default_factory=SleepConfig)
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE
    load_tracking: bool = False  # --enable-server-load-tracking
    fastapi_docs: bool = True  # not --disable-fastapi-docs: /openapi.json, /docs, /redoc
    server_load: int = 0  # GET /load: in-flight requests of the tracked routes
    engine_args: Any = None  # for /server_info
    adapters: LoRAAdapters | None = None
    lora_states: LoRARequestStates | None = None
    sleep_control: SleepControl | None = None
    kv_event_sources: dict[int, dict[str, Any]] = field(default_factory=dict)  # GET /kv_event_sources

    @classmethod
    def from_cli(cls, args: argparse.Namespace, environ: Any = None) -> "ServeExtensions":
        """ValueError (naming the flag) for a bad combination."""
        env = os.environ if environ is None else environ
        return cls(lora=LoRAConfig.from_cli(args, env), sleep=SleepConfig.from_cli(args),
                   pooling=PoolingConfig.from_cli(args), dev_mode=env_flag(env, "VLLM_SERVER_DEV_MODE"),
                   load_tracking=bool(getattr(args, "enable_server_load_tracking", False)),
                   fastapi_docs=not getattr(args, "disable_fastapi_docs", False))

    @property
    def generate(self) -> bool:
        return not self.pooling.enabled

    def configure_engine(self, engine_args: Any) -> None:
        """What the engine simulates of these features: the LoRA batch limit and load times."""
        if self.lora.enabled:
            engine_args.max_loras = self.lora.max_loras
            engine_args.max_cpu_loras = self.lora.max_cpu_loras
            engine_args.lora_load_time = self.lora.load_time_ms / 1000.0
            engine_args.lora_swap_in_time = self.lora.swap_in_time_ms / 1000.0

    def load_static_adapters(self, served_model_names: list[str]) -> None:
        """--lora-modules, once; ValueError names the flag (vLLM fails its start-up)."""
        # with runtime updating the registry exists even without --enable-lora: vLLM's load route
        # is there and the engine refuses the adapter
        if (self.lora.enabled or self.lora.runtime_updating) and self.adapters is None:
            adapters = LoRAAdapters(self.lora, served_model_names)
            adapters.load_static()
            self.adapters = adapters

    def wrap_engine(self, engine: Any, served_model_names: list[str], metrics: Any) -> Any:
        """The engine as every endpoint sees it (LoRA use is counted)."""
        self.load_static_adapters(served_model_names)
        if self.lora.enabled:
            self.lora_states = LoRARequestStates(self.lora.max_loras)
            if hasattr(engine, "add_output_listener"):
                engine.add_output_listener(self.lora_states.on_engine_outputs)
            registry = getattr(metrics, "registry", None)
            if registry is not None:
                registry.register(self.lora_states)
        if self.dev_mode:
            self.sleep_control = SleepControl(engine, self.sleep, metrics)
        if self.lora_states is None:
            return engine
        return FrontendEngine(engine, self.lora_states)

    def counted(self, handler: Callable) -> Callable:
        """vLLM's load_aware_call: a generation route counts itself in `server_load` while it runs
        (--enable-server-load-tracking)."""
        async def counted(ctx: Any) -> None:
            self.server_load += 1
            try:
                await handler(ctx)
            finally:
                self.server_load -= 1
        return counted

    def server_config(self, app: Any) -> dict[str, Any]:
        from ..vllm.management import plain

        return {"model": app.settings.model_root or app.settings.model_name,
                "served_model_name": app.settings.served_model_names,
                "max_model_len": app.settings.max_model_len, "data_parallel_size": app.settings.engine_count,
                "runner": "pooling" if self.pooling.enabled else "generate", "lora_config": plain(self.lora)
                if self.lora.enabled else None, "enable_sleep_mode": self.sleep.enabled,
                "engine_args": plain(self.engine_args)}

    def lora_report(self) -> dict[str, Any]:
        """The control API's view: loaded adapters with their running/waiting/total requests."""
        if self.adapters is None or not self.lora.enabled:
            return {"enabled": False, "max_loras": None, "max_cpu_loras": None, "adapters": []}
        counts = self.lora_states.counts() if self.lora_states else {}
        totals = self.lora_states.totals if self.lora_states else {}
        names = list(self.adapters.requests) + [n for n in counts if n not in self.adapters.requests]
        adapters = []
        for name in names:
            lora = self.adapters.requests.get(name)
            running, waiting = counts.get(name, (0, 0))
            adapters.append({"name": name, "id": lora.lora_int_id if lora else None,
                             "path": lora.lora_path if lora else None, "loaded": lora is not None,
                             "running": running, "waiting": waiting, "requests_total": totals.get(name, 0)})
        return {"enabled": True, "max_loras": self.lora.max_loras, "max_cpu_loras": self.lora.max_cpu_loras,
                "adapters": adapters}


class FrontendEngine:
    """An AsyncEngine whose submitted requests are announced to the LoRA request states (which
    adapter each request id runs with, as vLLM's output processor knows it)."""

    def __init__(self, engine: Any, lora_states: LoRARequestStates):
        self._engine = engine
        self._lora_states = lora_states

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def _admit(self, request: EngineCoreRequest) -> None:
        self._lora_states.on_submit(request)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        await self._admit(request)
        gen = self._engine.generate(request)
        try:
            async for out in gen:
                yield out
        finally:
            await gen.aclose()  # leaving early must abort in the engine now, not at garbage collection

    async def push(self, request: EngineCoreRequest, deliver: Callable[[EngineCoreOutput], bool],
                   take: Callable[[int], int] | None = None, batch_reader: Any = None) -> AsyncIterator[None]:
        await self._admit(request)
        gen = self._engine.push(request, deliver, take, batch_reader)
        try:
            async for _ in gen:
                yield None
        finally:
            await gen.aclose()
