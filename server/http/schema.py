"""The published OpenAPI document (/openapi.json), describing the bodies and answers the routes really have.

FastAPI documents what it parses itself. The generation routes read their body off the event loop
(openai.parse_body) and validation failures answer 400 in the API's own format, so FastAPI's own
document would show no request body for them and a 422 nobody sends. `document(app, bodies)`
starts from FastAPI's and fixes both: every route in `bodies` gets its pydantic model as its
required JSON body, and every answer FastAPI lists as 422 is listed as 400 with the error body
the route's API sends (OpenAI's error object, or TF Serving's {"error": message}).
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_TF_SERVING_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def document(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> dict[str, Any]:
    """The app's OpenAPI document; `bodies` maps a POST path to the model its handler parses."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["OpenAIError"] = _OPENAI_ERROR
    schemas["TFServingError"] = _TF_SERVING_ERROR
    for path, model in bodies.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for path, item in doc.get("paths", {}).items():
        error = "TFServingError" if ":predict" in path or path.endswith("/metadata") else "OpenAIError"
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if op.get("requestBody") or op.get("parameters"):
                responses["400"] = {"description": "a malformed or invalid request", "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
    for name in ("HTTPValidationError", "ValidationError"):
        if not _referenced(doc, name):
            schemas.pop(name, None)
    return doc


def _referenced(doc: dict, name: str) -> bool:
    return f'"#/components/schemas/{name}"' in json.dumps(doc)
