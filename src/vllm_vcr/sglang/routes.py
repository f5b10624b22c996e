"""SGLang's native routes, served beside the OpenAI ones with `--engine-type sglang`."""

from __future__ import annotations

from typing import Any

from ..http.routes import SGLANG, Family, Route, RouteConfig


def services(app: Any, config: RouteConfig) -> None:
    if SGLANG(config):
        from .serving import SGLangServing

        app.sglang = SGLangServing(app)


FAMILY = Family("sglang", services=services, about="SGLang's own routes", routes=(
    Route("/generate", ("POST",), lambda a: a.sglang.generate, SGLANG, generation=True,
          doc="SGLang's native generation (text or input_ids; SSE with `stream`)"),
    Route("/get_model_info", ("GET",), lambda a: a.sglang.model_info, SGLANG, doc="SGLang's model info"),
    Route("/model_info", ("GET",), lambda a: a.sglang.model_info, SGLANG, doc="SGLang's model info (newer name)"),
    Route("/get_server_info", ("GET",), lambda a: a.sglang.server_info, SGLANG,
          doc="SGLang's server arguments, scheduler info and per-rank state"),
    Route("/health_generate", ("GET",), lambda a: a.sglang.health_generate, SGLANG,
          doc="health through a one-token generation"),
    Route("/flush_cache", ("GET", "POST"), lambda a: a.sglang.flush_cache, SGLANG, doc="reset the prefix cache"),
))
