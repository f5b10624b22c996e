"""vLLM's own routes: server basics, SageMaker, operator and dev-mode routes, LoRA, elastic EP,
and the tokens-in/tokens-out, render and derender routes of `--enable-scale-out`."""

from __future__ import annotations

from typing import Any

from ..http.routes import DEV_MODE, DOCS, GENERATE, RUNTIME_LORA, SCALE_OUT, Family, Route, RouteConfig
from .basics import BasicServing
from .management import Management
from .rl import DevRoutes
from .tokens import scale_out_disabled


def services(app: Any, config: RouteConfig) -> None:
    app.basics = BasicServing(app)
    app.management = Management(app, app.extensions)
    app.dev = DevRoutes(app)
    if SCALE_OUT(config):
        from .derender import DerenderServing
        from .render import RenderServing
        from .tokens import TokensServing

        app.tokens = TokensServing(app.engine, app.tokenizer, app.settings, app.metrics)
        app.render = RenderServing(app)
        app.derender = DerenderServing(app)


def _dev(path: str, method: str, name: str, doc: str) -> Route:
    return Route(path, (method,), lambda a: getattr(a.management, name), DEV_MODE, doc=doc)


def _rl(path: str, method: str, name: str, doc: str, **kw: Any) -> Route:
    return Route(path, (method,), lambda a: getattr(a.dev, name), DEV_MODE, doc=doc, **kw)


_NO_WEIGHTS = "no weights here: a 500 naming the call, as vLLM in front of `play`"


def _scale_out(path: str, handler: Any, doc: str, **kw: Any) -> Route:
    # (vLLM registers these outside its OpenAPI schema)
    return Route(path, ("POST",), handler, switch=SCALE_OUT, closed=scale_out_disabled, in_schema=False, doc=doc,
                 **kw)


_SLEEP = "sleep mode ([sleep](#sleep-mode-and-pause))"
_OPS = "operator endpoint ([operator endpoints](#operator-endpoints))"

FAMILY = Family("vllm", services=services, about="vLLM's own routes", routes=(
    Route("/health", ("GET",), lambda a: a.basics.health, doc="200 with an empty body while the engines run, else 503"),
    Route("/ping", ("GET", "POST"), lambda a: a.basics.health, doc="SageMaker's health check"),
    Route("/version", ("GET",), lambda a: a.basics.version,
          doc='`{"version": "0.32.0", "vllm_vcr_version": ...}`: the vLLM release whose API is reproduced'),
    Route("/metrics", ("GET", "POST", "HEAD"), lambda a: a.basics.metrics,
          doc="Prometheus ([metrics.md](metrics.md)); HEAD answers no body", unlisted_methods=("POST", "HEAD")),
    Route("/openapi.json", ("GET",), lambda a: a.openapi, DOCS, in_schema=False,
          doc="the OpenAPI 3.1 description of the served routes"),
    Route("/invocations", ("POST",), lambda a: a.basics.invocations, generation=True,
          doc="SageMaker: chat or completion by the body's shape"),
    Route("/load", ("GET",), lambda a: a.management.load,
          doc="in-flight generation requests (with `--enable-server-load-tracking`)"),
    Route("/v1/load_lora_adapter", ("POST",), lambda a: a.management.load_lora_adapter, RUNTIME_LORA,
          json_only=True, doc="load a LoRA adapter ([LoRA](#lora-adapters))"),
    Route("/v1/unload_lora_adapter", ("POST",), lambda a: a.management.unload_lora_adapter, RUNTIME_LORA,
          json_only=True, doc="unload a LoRA adapter"),
    _dev("/sleep", "POST", "sleep", _SLEEP),
    _dev("/wake_up", "POST", "wake_up", _SLEEP),
    _dev("/is_sleeping", "GET", "is_sleeping", _SLEEP),
    _dev("/release_kv_cache_memory", "POST", "release_kv_cache_memory", _SLEEP),
    _dev("/pause", "POST", "pause", _SLEEP),
    _dev("/resume", "POST", "resume", _SLEEP),
    _dev("/is_paused", "GET", "is_paused", _SLEEP),
    _dev("/reset_prefix_cache", "POST", "reset_prefix_cache", _OPS),
    _dev("/reset_mm_cache", "POST", "reset_nothing", _OPS),
    _dev("/reset_encoder_cache", "POST", "reset_nothing", _OPS),
    _dev("/server_info", "GET", "server_info", _OPS),
    Route("/kv_event_sources", ("GET",), lambda a: a.dev.kv_event_sources,
          doc="each engine's KV-event publisher config by DP rank (`{}` without KV events)"),
    Route("/docs", ("GET",), lambda a: a.basics.docs, DOCS, in_schema=False, doc="Swagger UI over `/openapi.json`"),
    Route("/docs/oauth2-redirect", ("GET",), lambda a: a.basics.oauth2_redirect, DOCS, in_schema=False,
          doc="Swagger UI's OAuth2 redirect page"),
    Route("/redoc", ("GET",), lambda a: a.basics.redoc, DOCS, in_schema=False, doc="ReDoc over `/openapi.json`"),
    _rl("/collective_rpc", "POST", "collective_rpc", "RPC into the workers: vLLM's checks, then a 500 (no workers)"),
    _rl("/abort_requests", "POST", "abort_requests", "abort the named requests (`request_ids`) or all in flight"),
    _rl("/get_world_size", "GET", "get_world_size", "TP x PP (x DP with `include_dp`)"),
    _rl("/weight_info", "GET", "weight_info", "the weight version"),
    _rl("/update_weight_version", "POST", "update_weight_version", "set the weight version"),
    _rl("/weight_checker", "POST", "weight_checker", "checksums of no weights; compare against a baseline"),
    _rl("/init_weight_transfer_engine", "POST", "init_weight_transfer_engine", _NO_WEIGHTS),
    _rl("/shutdown_weight_transfer_engine", "POST", "weight_transfer_call", _NO_WEIGHTS),
    _rl("/start_weight_update", "POST", "weight_transfer_call", _NO_WEIGHTS),
    _rl("/start_draft_weight_update", "POST", "weight_transfer_call", _NO_WEIGHTS),
    _rl("/update_weights", "POST", "update_weights", _NO_WEIGHTS),
    _rl("/finish_weight_update", "POST", "finish_weight_update", _NO_WEIGHTS),
    Route("/scale_elastic_ep", ("POST",), lambda a: a.management.scale_elastic_ep, GENERATE, json_only=True,
          doc="elastic EP: vLLM's validation; a scale answers \"Scale failed\""),
    Route("/is_scaling_elastic_ep", ("POST",), lambda a: a.management.is_scaling_elastic_ep, GENERATE,
          doc="elastic EP state"),
    _scale_out("/inference/v1/generate", lambda a: a.tokens.generate, "tokens in, tokens out", gate=GENERATE,
               generation=True),
    _scale_out("/inference/v1/abort_requests", lambda a: a.tokens.abort_requests, "a no-op 200"),
    _scale_out("/v1/chat/completions/render", lambda a: a.render.render_chat, "a chat request rendered to tokens"),
    _scale_out("/v1/completions/render", lambda a: a.render.render_completion,
               "a completion request rendered to tokens"),
    _scale_out("/v1/messages/render", lambda a: a.render.render_messages, "a Messages request rendered to tokens"),
    _scale_out("/v1/responses/render", lambda a: a.render.render_responses,
               "a Responses request rendered to tokens"),
    _scale_out("/v1/chat/completions/derender", lambda a: a.derender.derender_chat,
               "one generate chunk back to a chat chunk"),
    _scale_out("/v1/completions/derender", lambda a: a.derender.derender_completion,
               "one generate chunk back to a completion chunk"),
))
