"""GET /loras on the control API: the LoRA adapters `serve` knows and their requests.

The adapter registry lives in `serve`'s frontend, so the route is added by `serve` after both
servers exist; it reads a snapshot function and never touches the engines.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def add_lora_route(app: Any, report: Callable[[], dict[str, Any]]) -> None:
    """Serve `report()` (JSON) at GET /loras on the control app."""

    async def get_loras(request: Request) -> Response:
        return Response(msgspec.json.encode(report()) + b"\n", media_type="application/json")

    app.router.routes.append(Route("/loras", get_loras, methods=["GET"]))
