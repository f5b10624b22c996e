"""GET /openapi.json: the OpenAPI 3.1 description of `serve`'s routes, as vLLM's FastAPI frontend
publishes one. Request bodies are the pydantic models the handlers validate with; every route the
app serves is listed (a route without a known body schema gets a generic object body)."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..http.routes import Route

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}


def _schema_of(models: list[type], components: dict[str, Any]) -> dict[str, Any]:
    refs = []
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        refs.append({"$ref": _REF.format(model=model.__name__)})
    return refs[0] if len(refs) == 1 else {"anyOf": refs}


def _responses(has_body: bool) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
    out: dict[str, Any] = {"200": {"description": "Successful Response"}}
    if has_body:
        out["400"] = {"description": "Bad Request", **error}
        out["404"] = {"description": "Model not found", **error}
    return out


def build_openapi(routes: list[tuple[Route, bool]]) -> dict[str, Any]:
    """The document for the routes an app serves (http/routes.py `served`): every path and method
    of the routes vLLM lists in its schema, a path's variable segment as an OpenAPI path parameter."""
    components: dict[str, Any] = {"ErrorResponse": _ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for route, _ in sorted(routes, key=lambda r: r[0].path):
        if not route.in_schema:
            continue
        item: dict[str, Any] = paths.setdefault(route.path, {})
        params = [{"name": route.path[route.path.index("{") + 1:route.path.index("}")], "in": "path",
                   "required": True, "schema": {"type": "string"}}] if route.pattern is not None else None
        for method in route.methods:
            if method in route.unlisted_methods:
                continue
            has_body = method == "POST" and bool(route.body)
            op: dict[str, Any] = {"operationId": f"{method.lower()}{_op_name(route.path)}",
                                  "responses": _responses(has_body)}
            if params:
                op["parameters"] = params
            if has_body:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _schema_of(list(route.body), components)}}}
            item[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "vllm-vcr serve (vLLM's OpenAI-compatible API)",
                                         "version": __version__},
            "paths": paths, "components": {"schemas": components}}


def _op_name(path: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in path)
