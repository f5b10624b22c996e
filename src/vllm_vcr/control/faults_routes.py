"""The control API's fault routes (`serve` only): GET/PUT/DELETE /faults and /gauges.

Thin: bodies are decoded here and handed to the FaultController (faults/), whose errors become
400 (a value it cannot use) or 422 (a body that does not match the schema)."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..faults import RATE_FIELDS, FaultController, FaultSchemaError, FaultSpecError
from .schema import ControlError, _decode_object

__all__ = ["RATE_FIELDS", "apply_rates", "check_rates", "fault_routes"]


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj) + b"\n", status_code=status, media_type="application/json")


def _as_control_error(e: FaultSpecError) -> ControlError:
    return ControlError(422 if isinstance(e, FaultSchemaError) else 400, str(e))


def apply_rates(faults: FaultController, patch: dict[str, Any]) -> dict[str, Any]:
    try:
        return faults.patch_rates(patch)
    except FaultSpecError as e:
        raise _as_control_error(e) from None


def check_rates(faults: FaultController, patch: dict[str, Any]) -> None:
    """The checks of apply_rates, applying nothing."""
    try:
        faults.check_rates(patch)
    except FaultSpecError as e:
        raise _as_control_error(e) from None


def fault_routes(faults: FaultController) -> list[Route]:
    async def faults_route(request: Request) -> Response:
        if request.method == "PUT":
            try:
                return _json(faults.set_script(_decode_object(await request.body())))
            except FaultSpecError as e:
                raise _as_control_error(e) from None
        if request.method == "DELETE":
            faults.clear_script()
        return _json(faults.describe_script())

    async def gauges_route(request: Request) -> Response:
        if request.method == "PUT":
            try:
                return _json(faults.set_gauges(_decode_object(await request.body())))
            except FaultSpecError as e:
                raise _as_control_error(e) from None
        if request.method == "DELETE":
            faults.clear_gauges()
        return _json(faults.describe_gauges())

    return [Route("/faults", faults_route, methods=["GET", "PUT", "DELETE"]),
            Route("/gauges", gauges_route, methods=["GET", "PUT", "DELETE"])]
