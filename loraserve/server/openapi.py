"""The server's OpenAPI schema, served at /openapi.json (and read by the fuzz test).

The routes parse their bodies themselves (server/context.parse_body: our own 400s, limits
checked before pydantic), so FastAPI cannot see their request models; they are filled in here
from server/protocol.py, the one definition of each body. Every error response is declared as
the OpenAI error object.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from loraserve.server import protocol as P

REQUEST_BODIES = {
    "/v1/completions": P.CompletionRequest,
    "/v1/chat/completions": P.ChatCompletionRequest,
    "/v1/load_lora_adapter": P.LoadLoraRequest,
    "/load_lora_adapter": P.LoadLoraRequest,
    "/v1/unload_lora_adapter": P.UnloadLoraRequest,
    "/unload_lora_adapter": P.UnloadLoraRequest,
}

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}


def openapi_schema(app: FastAPI) -> dict:
    schema = get_openapi(title="loraserve", version="0.1.0", openapi_version="3.1.0",
                         routes=app.routes)
    models = sorted(set(REQUEST_BODIES.values()), key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models],
                                    ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    components["Error"] = ERROR_SCHEMA
    error = {"description": "an OpenAI-shaped error",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            op["responses"] = {"200": {"description": "OK"}, "4XX": error}
            model = REQUEST_BODIES.get(path)
            if model is not None and method == "post":
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": refs[(model, "validation")]}}}
    return schema
