"""The published OpenAPI document (/openapi.json), describing the bodies and answers the routes really have.

FastAPI documents what it parses itself. The generation routes read their body off the event loop
(prepare.parse_body) and validation failures answer 400 in the API's own format, so FastAPI's own
document would show no request body for them and a 422 nobody sends. `document(app, bodies)`
starts from FastAPI's and fixes both: every route in `bodies` gets its pydantic model as its
required JSON body, and every answer FastAPI lists as 422 is listed as 400; every route in
`answers` gets its answer's model as its 200 JSON body (and text/event-stream, what it sends
with `stream: true`); each route also lists
the errors it really gives (401 with an API key, 404 for a model not served, 408, 413, 429 and 503 with
Retry-After) with the error body its API sends (OpenAI's error object, or TF Serving's
{"error": message} for the routes tagged "tf-serving"); /metrics is text, /ready's 503 is listed.
"""
from __future__ import annotations

import json
from typing import Any, Collection, Mapping

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
# one server-sent event: its `data` a JSON chunk of the answer (or [DONE]), `event` naming its type
# where the API names them (the Responses API)
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_TF_SERVING_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def document(app: FastAPI, bodies: Mapping[str, type[BaseModel]], *, answers: Mapping[str, type[BaseModel]] = {},
             admitted: Collection[str] = (), open_paths: Collection[str] | None = None) -> dict[str, Any]:
    """The app's OpenAPI document; `bodies` maps a POST path to the model its handler parses,
    `answers` a POST path to the model of its (non-streamed) answer, `admitted` lists the paths that
    count against the admission bound (429, and 503 while warming up or shutting down), `open_paths`
    the paths answered without the API key (None: the server has no key; every other path answers
    401 without it)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["OpenAIError"] = _OPENAI_ERROR
    schemas["TFServingError"] = _TF_SERVING_ERROR
    for path, model in bodies.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": _component(schemas, model, "validation")}}}
    for path, model in answers.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        op.setdefault("responses", {})["200"] = {"description": "the answer; with `stream: true`, server-sent events",
                                                 "content": {"application/json": {"schema": _component(
                                                     schemas, model, "serialization")},
                                                     "text/event-stream": {"schema": _SSE_EVENT}}}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            error = "TFServingError" if "tf-serving" in op.get("tags", ()) else "OpenAIError"
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            names_model = "model" in _body_properties(schemas, op)
            for status, description in _answers(path, method, op, names_model, admitted, open_paths):
                responses[status] = {"description": description, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
                if status in ("429", "503"):
                    responses[status]["headers"] = {"Retry-After": {"schema": {"type": "string"},
                                                                    "description": "seconds to wait"}}
    ready = doc.get("paths", {}).get("/ready", {}).get("get")
    if ready is not None:
        ready["responses"]["503"] = {"description": "warming up, failed, or shutting down", "content": {
            "application/json": {"schema": {"type": "object", "properties": {
                "status": {"type": "string"}, "detail": {"type": ["string", "null"]}}}}}}
    metrics = doc.get("paths", {}).get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"]["200"] = {"description": "Prometheus text exposition format", "content": {
            "text/plain": {"schema": {"type": "string"}}}}
    for name in ("HTTPValidationError", "ValidationError"):
        if not _referenced(doc, name):
            schemas.pop(name, None)
    return doc


def _component(schemas: dict, model: type[BaseModel], mode: str) -> dict:
    """A $ref to `model`'s schema, added (with the models it uses) to the document's components. A
    name already there with another schema is an error: two models may not share a name."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
    for name, sub in [*schema.pop("$defs", {}).items(), (model.__name__, schema)]:
        if schemas.setdefault(name, sub) != sub:
            raise ValueError(f"two models named {name} in the OpenAPI document ({mode} schema of {model.__name__} "
                             f"differs from the one already there); rename one")
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _answers(path: str, method: str, op: dict, names_model: bool, admitted: Collection[str],
             open_paths: Collection[str] | None) -> list[tuple[str, str]]:
    """The error answers an operation can give besides FastAPI's, as (status, description)."""
    out = []
    if op.get("requestBody") or op.get("parameters"):
        out.append(("400", "a malformed or invalid request"))
    if open_paths is not None and path not in open_paths:
        out.append(("401", "a missing or wrong API key"))
    if path.startswith("/v1/models/{") or names_model:
        out.append(("404", "the model named is not served here"))
    if method == "post":
        out += [("408", "the body did not arrive within --body-timeout"),
                ("413", "the body is larger than --max-body-mib")]
    if path in admitted:
        out += [("429", "overloaded: more requests in flight than --max-pending"),
                ("503", "warming up, failed, or shutting down")]
    return out


def _body_properties(schemas: dict, op: dict) -> dict:
    """The properties of an operation's JSON body (ours or the one FastAPI parses), {} without one."""
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        schema = schemas.get(ref.rsplit("/", 1)[1], {})
    return schema.get("properties", {})


def _referenced(doc: dict, name: str) -> bool:
    return f'"#/components/schemas/{name}"' in json.dumps(doc)
