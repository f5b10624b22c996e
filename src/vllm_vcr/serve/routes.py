"""The route registry of `serve`: the API families in the order their routes are looked up.

`python -m vllm_vcr.serve.routes` prints the route table of docs/serve.md (a test checks that the
page holds exactly this table).
"""

from __future__ import annotations

from typing import Any

from ..anthropic.routes import FAMILY as ANTHROPIC
from ..http.routes import Family, Route, RouteConfig
from ..openai.routes import FAMILY as OPENAI
from ..sglang.routes import FAMILY as SGLANG
from ..vllm.routes import FAMILY as VLLM

FAMILIES: tuple[Family, ...] = (OPENAI, ANTHROPIC, VLLM, SGLANG)


def route_config(settings: Any, extensions: Any) -> RouteConfig:
    """The RouteConfig of a serve app (its settings and ServeExtensions)."""
    return RouteConfig(engine_type=settings.engine_type,
                       runner="pooling" if extensions.pooling.enabled else "generate",
                       scale_out=bool(settings.scale_out), dev_mode=extensions.dev_mode,
                       runtime_lora=extensions.lora.runtime_updating, load_tracking=extensions.load_tracking,
                       fastapi_docs=extensions.fastapi_docs)


def _methods(route: Route) -> str:
    return ", ".join(f"`{m}`" for m in route.methods)


def markdown_table(families: tuple[Family, ...] = FAMILIES) -> str:
    """The route table of docs/serve.md."""
    lines = ["| route | methods | API | served when | what |", "| --- | --- | --- | --- | --- |"]
    for family in families:
        for r in family.routes:
            when = r.gate.label
            if r.switch is not None:
                when = (r.switch.label if when == "always" else f"{when}, with {r.switch.label}") + " (else 403)"
            lines.append(f"| `{r.path}` | {_methods(r)} | {family.about} | {when} | {r.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table(), end="")
