"""Routes as data: what an API family serves, declared once, next to vLLM's rule for when it exists.

Each API family (`openai/`, `anthropic/`, `vllm/`, `sglang/`) has a `routes.py` whose `FAMILY`
lists its routes. `serve`'s app (serve/app.py) is built from those tables, and so are
`/openapi.json` (serve/openapi.py), the route table in docs/serve.md (`python -m
vllm_vcr.serve.routes`) and the route-set tests. A route's `handler` picks the bound handler from
the app's services (the objects a family's `services` hook puts on the app: `app.chat`,
`app.responses`, ...); its `gate` says when vLLM registers it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

Handler = Callable[[Any], Awaitable[None]]  # takes a RequestContext (http/serving_base.py)
HandlerOf = Callable[[Any], Handler]  # the app -> the bound handler


@dataclass(frozen=True)
class RouteConfig:
    """What decides which routes exist: flags and environment as vLLM reads them at start-up."""

    engine_type: str = "vllm"  # --engine-type
    runner: str = "generate"  # --runner: "pooling" serves the pooling routes instead of generation
    scale_out: bool = False  # --enable-scale-out / --tokens-only
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1
    runtime_lora: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    load_tracking: bool = False  # --enable-server-load-tracking
    fastapi_docs: bool = True  # not --disable-fastapi-docs


@dataclass(frozen=True)
class Gate:
    """vLLM's condition for registering a route, with the words the docs use for it."""

    label: str
    test: Callable[[RouteConfig], bool]

    def __call__(self, config: RouteConfig) -> bool:
        return self.test(config)


ALWAYS = Gate("always", lambda c: True)
GENERATE = Gate("a generative model (not `--runner pooling`)", lambda c: c.runner != "pooling")
POOLING = Gate("`--runner pooling`", lambda c: c.runner == "pooling")
SCALE_OUT = Gate("`--enable-scale-out` / `--tokens-only`", lambda c: c.scale_out)
DEV_MODE = Gate("`VLLM_SERVER_DEV_MODE=1`", lambda c: c.dev_mode)
RUNTIME_LORA = Gate("`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`", lambda c: c.runtime_lora)
DOCS = Gate("unless `--disable-fastapi-docs`", lambda c: c.fastapi_docs)


def engine_type_gate(name: str) -> Gate:
    """The routes of one engine type's own API (served beside the OpenAI ones)."""
    return Gate(f"`--engine-type {name}`", lambda c: c.engine_type == name)


SGLANG = engine_type_gate("sglang")


@dataclass(frozen=True)
class Route:
    """One path and its methods.

    `path` may hold one `{name}` segment (`/v1/responses/{response_id}/cancel`). A `generation`
    route runs under the disconnect watcher, goes through fault injection and counts towards
    `/load`; `json_only` routes refuse any body that is not `application/json` before reading it
    (vLLM's validate_json_request); `closed` answers a gated route while its gate is shut (vLLM's
    403 for the scale-out routes; otherwise the route is absent: 404). `body` lists the request
    schemas `/openapi.json` shows."""

    path: str
    methods: tuple[str, ...]
    handler: HandlerOf
    gate: Gate = ALWAYS
    generation: bool = False
    json_only: bool = False
    switch: Gate | None = None
    closed: Handler | None = None
    body: tuple[type, ...] = ()
    in_schema: bool = True  # listed in /openapi.json (FastAPI's include_in_schema)
    doc: str = ""
    unlisted_methods: tuple[str, ...] = ()  # methods served but not in /openapi.json (a mounted ASGI app's)

    @property
    def pattern(self) -> tuple[str, str] | None:
        """(prefix, suffix) around the path's one variable segment; None for an exact path."""
        start = self.path.find("{")
        if start < 0:
            return None
        end = self.path.index("}", start)
        return self.path[:start], self.path[end + 1:]


@dataclass(frozen=True)
class Family:
    """An API family: its routes, and the hook that puts its services on the app (called once, in
    family order, before any handler is looked up)."""

    name: str
    routes: Sequence[Route]
    services: Callable[[Any, RouteConfig], None] | None = None
    about: str = ""


def served(families: Sequence[Family], config: RouteConfig) -> list[tuple[Route, bool]]:
    """Every route of `families` that exists for `config`, in declaration order, with whether it
    is switched on (False: it answers with its `closed` handler)."""
    return [(route, route.switch is None or route.switch(config))
            for family in families for route in family.routes if route.gate(config)]
