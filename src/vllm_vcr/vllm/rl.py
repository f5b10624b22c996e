"""vLLM 0.32's development routes for RL trainers (VLLM_SERVER_DEV_MODE=1): aborting requests,
RPC into the workers, the world size, the weight version and the weight-transfer calls, plus
GET /kv_event_sources (served always).

There are no workers and no weights here. What vLLM answers from the frontend's own state is
answered the same way (the weight version, the world size, the checksums of no weights, aborts);
what needs the workers (collective RPC, a weight transfer, resetting weights) fails as vLLM's
frontend fails in front of `vllm-vcr play`, whose engine declines those calls: a 500 naming the call.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from ..engine.types import not_simulated
from ..frontend.errors import HTTPError, validation_error
from ..http.serving_base import RequestContext, encode
from ..http.sse import send_bytes
from .management import _bool_query, http_exception

_REQUIRED = object()


def _rpc_failure() -> HTTPError:
    """The engine's refusal of a collective RPC, as vLLM's catch-all handler answers it."""
    return HTTPError(500, not_simulated("collective_rpc"), "InternalServerError")


def embedded_body(ctx: RequestContext, fields: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """FastAPI's `Body(embed=True)` parameters: each field of the JSON object validated on its
    own, a missing required one reported with input None, errors located at body.<name>."""
    data: Any = {}
    if ctx.body and not ctx.body.isspace():
        try:
            data = json.loads(ctx.body)
        except ValueError as e:
            raise validation_error([{"type": "json_invalid", "loc": (getattr(e, "pos", 0),),
                                     "msg": "JSON decode error", "input": {},
                                     "ctx": {"error": getattr(e, "msg", str(e))}}]) from None
    if not isinstance(data, dict):
        data = {}
    out, errors = {}, []
    for name, (kind, default) in fields.items():
        if name not in data:
            if default is _REQUIRED:
                errors.append({"type": "missing", "loc": (name,), "msg": "Field required", "input": None})
            else:
                out[name] = default
            continue
        try:
            out[name] = TypeAdapter(kind).validate_python(data[name])
        except ValidationError as e:
            errors += [{**err, "loc": (name, *err["loc"])} for err in e.errors(include_url=False)]
    if errors:
        raise validation_error(errors)
    return out


def _json_object(ctx: RequestContext, invalid: str) -> dict[str, Any]:
    """The body of a route that reads `await request.json()` itself."""
    try:
        body = json.loads(ctx.body)
    except ValueError as e:
        raise http_exception(400, invalid.format(e=e)) from None
    if not isinstance(body, dict):
        raise http_exception(400, "Request body must be a JSON object")
    return body


def _aborted_count(external_ids: list[Any]) -> int:
    """How vLLM counts the requests /abort_requests aborted: each engine request, and each
    parallel-sampling parent (one per client request with n > 1)."""
    children: dict[Any, int] = {}
    for ext in external_ids:
        children[ext] = children.get(ext, 0) + 1
    return len(external_ids) + sum(1 for n in children.values() if n > 1)


class DevRoutes:
    """The handlers; the weight version lives here with the engines in this process, in the
    engine-core processes (utility calls) behind `--api-server-count`, as vLLM keeps it in the
    engine core."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.weight_version = "default"

    # -- always served -----------------------------------------------------------------------------
    async def kv_event_sources(self, ctx: RequestContext) -> None:
        """Each engine's KV-event publisher config by DP rank ({} when KV events are off)."""
        sources = getattr(self.app.extensions, "kv_event_sources", None) or {}
        await send_bytes(ctx.send, 200, encode({str(rank): cfg for rank, cfg in sorted(sources.items())}))

    # -- requests and workers ----------------------------------------------------------------------
    async def abort_requests(self, ctx: RequestContext) -> None:
        """Abort the named requests (client ids), or every request in flight."""
        body = _json_object(ctx, "Invalid JSON format")
        ids = body.get("request_ids")
        wanted = set(ids) if ids else None

        engine = self.app.engine
        if hasattr(engine, "abort_tracked"):  # an engine-core client: this API server's requests, as vLLM's
            aborted_ids = engine.abort_tracked(wanted)
            counts = [_aborted_count([ext for _, ext in aborted_ids])]
        else:
            def abort(core: Any) -> int:
                rids = [rid for rid, r in core.requests.items() if wanted is None or r.external_id in wanted]
                if rids:
                    core.abort_requests(rids, notify=True)
                return _aborted_count([core.requests[rid].external_id for rid in rids])

            counts = await engine.call_all(abort)
        aborted = len(ids) if ids else sum(counts)
        await send_bytes(ctx.send, 200, encode({"status": "aborted", "aborted": aborted}))

    async def collective_rpc(self, ctx: RequestContext) -> None:
        body = _json_object(ctx, "JSON decode error: {e}")
        if body.get("method") is None:
            raise http_exception(400, "Missing 'method' in request body")
        raise _rpc_failure()

    async def get_world_size(self, ctx: RequestContext) -> None:
        include_dp = _bool_query(ctx, "include_dp", True)
        size = self.app.settings.engine_count if include_dp else 1  # TP x PP is 1: one simulated device
        await send_bytes(ctx.send, 200, encode({"world_size": size}))

    # -- weights -----------------------------------------------------------------------------------
    async def weight_info(self, ctx: RequestContext) -> None:
        utility = getattr(self.app.engine, "utility", None)
        if utility is not None:  # the engine-core processes hold it (vLLM keeps it in the engine core)
            self.weight_version = (await utility("get_weight_version"))[0]
        await send_bytes(ctx.send, 200, encode({"weight_version": self.weight_version}))

    async def update_weight_version(self, ctx: RequestContext) -> None:
        version = embedded_body(ctx, {"new_version": (str, _REQUIRED)})["new_version"]
        utility = getattr(self.app.engine, "utility", None)
        if utility is not None:
            await utility("set_weight_version", version)
        self.weight_version = version
        await send_bytes(ctx.send, 200, encode({"success": True, "new_version": version}))

    async def weight_checker(self, ctx: RequestContext) -> None:
        args = embedded_body(ctx, {"action": (Literal["checksum", "reset", "compare"], _REQUIRED),
                                   "baseline": (dict[str, str] | None, None)})
        action, baseline = args["action"], args["baseline"]
        if action == "reset":
            raise _rpc_failure()
        if action == "compare" and baseline is None:
            raise http_exception(400, "action='compare' requires a 'baseline' object")
        checksums: dict[str, str] = {}  # no weights, no checksums
        if action == "checksum":
            await send_bytes(ctx.send, 200, encode({"checksums": checksums}))
            return
        mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
        await send_bytes(ctx.send, 200, encode({"match": not mismatches, "mismatches": mismatches}))

    async def init_weight_transfer_engine(self, ctx: RequestContext) -> None:
        embedded_body(ctx, {"init_info": (dict[str, Any], _REQUIRED)})
        raise _rpc_failure()

    async def update_weights(self, ctx: RequestContext) -> None:
        embedded_body(ctx, {"update_info": (dict[str, Any] | list[dict[str, Any]], _REQUIRED)})
        raise _rpc_failure()

    async def finish_weight_update(self, ctx: RequestContext) -> None:
        embedded_body(ctx, {"weight_version": (str | None, None)})
        raise _rpc_failure()

    async def weight_transfer_call(self, ctx: RequestContext) -> None:
        """/shutdown_weight_transfer_engine, /start_weight_update, /start_draft_weight_update."""
        raise _rpc_failure()
