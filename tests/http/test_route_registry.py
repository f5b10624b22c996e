"""The route registry is the one list of routes: docs/serve.md's table is its rendering, every
route's handler exists on a built app, and /openapi.json lists exactly the routes a server serves
for its configuration (dev mode, scale-out, the pooling runner, SGLang)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_vcr.http.routes import RouteConfig, served
from vllm_vcr.serve.routes import FAMILIES, markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"


def test_the_docs_table_is_the_registry():
    text = DOC.read_text(encoding="utf-8")
    table = re.search(r"<!-- routes:begin -->\n(.*?)<!-- routes:end -->", text, re.S)
    assert table is not None, "docs/serve.md lost its route table markers"
    assert table.group(1) == markdown_table(), "docs/serve.md's route table is stale: python -m vllm_vcr.serve.routes"


def test_every_path_is_declared_once_per_method():
    seen = set()
    for family in FAMILIES:
        for route in family.routes:
            for method in route.methods:
                assert (method, route.path) not in seen, (method, route.path)
                seen.add((method, route.path))


@pytest.mark.parametrize("config", [
    RouteConfig(), RouteConfig(runner="pooling"), RouteConfig(scale_out=True), RouteConfig(dev_mode=True, runtime_lora=True),
    RouteConfig(engine_type="sglang"),
])
def test_gates_choose_the_routes(config):
    paths = {r.path for r, _ in served(FAMILIES, config)}
    assert ("/v1/completions" in paths) == (config.runner != "pooling")
    assert ("/v1/embeddings" in paths) == (config.runner == "pooling")
    assert ("/sleep" in paths) == config.dev_mode
    assert ("/v1/load_lora_adapter" in paths) == config.runtime_lora
    assert ("/generate" in paths) == (config.engine_type == "sglang")
    # the scale-out routes exist either way: switched off they answer vLLM's 403
    on = {r.path: switched for r, switched in served(FAMILIES, config)}
    assert on["/v1/chat/completions/render"] == config.scale_out


def test_every_engine_type_has_a_front_door():
    from vllm_vcr.engine.policy import engine_types
    from vllm_vcr.serve.engine_types import FRONT_DOORS

    assert set(FRONT_DOORS) == set(engine_types())
