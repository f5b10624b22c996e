"""GET /openapi.json: the OpenAPI 3.1 description of `serve`'s routes, as vLLM's FastAPI frontend
publishes one. Request bodies are the pydantic models the handlers validate with; every route the
app serves is listed (a route without a known body schema gets a generic object body)."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

_BODIES: dict[str, list[type]] = {
    "/v1/completions": [CompletionRequest],
    "/v1/chat/completions": [ChatCompletionRequest],
    "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
    "/detokenize": [DetokenizeRequest],
}
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


def build_openapi(routes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The document for `routes` (path -> {method: handler}), as the app holds them."""
    components: dict[str, Any] = {"ErrorResponse": _ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for path, methods in sorted(routes.items()):
        item: dict[str, Any] = {}
        for method in methods:
            op: dict[str, Any] = {"operationId": f"{method.lower()}{path.replace('/', '_').replace('.', '_')}",
                                  "responses": _responses(method == "POST" and path in _BODIES)}
            if method == "POST" and path in _BODIES:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _schema_of(_BODIES[path], components)}}}
            item[method.lower()] = op
        paths[path] = item
    return {"openapi": "3.1.0", "info": {"title": "vllm-vcr serve (vLLM's OpenAI-compatible API)",
                                         "version": __version__},
            "paths": paths, "components": {"schemas": components}}
