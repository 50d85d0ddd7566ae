"""`create_app(service) -> FastAPI`: the OpenAI APIs (`LLM_APIS`) for LLM artifacts, TF Serving's REST predict
API (http/tf_serving.py, and /v1/embeddings for encoders) for the others, /health, /ready, /metrics for both,
and the error handlers that answer in each API's own format.

Each API is one module with its `router` (its route handlers, preparation and renderer beside them) and,
for /openapi.json, `BODIES` (the bodies its routes parse themselves) and `ANSWERS` (their typed answers);
its wire models are in its `<api>_protocol.py`. Serving a new API is one more module in a tuple below.

Handlers never touch the device: LLM requests go to the engine's loop thread
(`engine.add_request` returns a stream), predict requests to the batcher's
worker. A client that disconnects aborts its request at once (the stream's
context manager), so its KV blocks are freed before the next step. Every
error answers in the API's own format (OpenAI's {"error": {...}} or TF
Serving's {"error": "..."}) and the server keeps serving.
"""
from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..services import LLMService, PredictService
from . import chat, completions, embeddings, models, responses, schema, tf_serving, tokenization
from .errors import RETRY_AFTER, ApiError
from .protocol import error_body


# the API modules each service serves, in route order
LLM_APIS = (models, completions, chat, tokenization, responses)
PREDICT_APIS = (tf_serving,)        # + embeddings when the encoder has a pooling config


def _apis(service: LLMService | PredictService) -> tuple:
    if isinstance(service, LLMService):
        return LLM_APIS
    return PREDICT_APIS + ((embeddings,) if service.embedder is not None else ())


def _is_predict_path(path: str) -> bool:
    return ":predict" in path or path.endswith("/metadata")


def _error_response(request: Request, status: int, message: str, *, type_: str = "invalid_request_error",
                    param: str | None = None, headers: dict | None = None) -> JSONResponse:
    if _is_predict_path(request.url.path) or isinstance(getattr(request.app.state, "service", None), PredictService) \
            and request.url.path.startswith("/v1/models/"):
        return JSONResponse({"error": message}, status_code=status, headers=headers)   # TF Serving's format
    return JSONResponse(error_body(message, type_=type_, param=param, code=str(status)), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if e.get("type") == "extra_forbidden":
        return f"unknown field '{'.'.join(loc)}'; remove it (see the API reference for supported fields)", loc[-1] if loc else None
    if e.get("type") == "missing":
        return f"missing required field '{'.'.join(loc)}'", loc[-1] if loc else None
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    field = ".".join(loc)
    return (f"invalid value for '{field}': {msg}" if field else msg), (loc[-1] if loc else None)


def create_app(service: LLMService | PredictService, *, api_key: str | None = None,
               max_body_bytes: int = 16 << 20) -> FastAPI:
    """The HTTP app for one service; `api_key` guards /v1/* when given; bodies over `max_body_bytes`
    answer 413 before they are read whole."""
    app = FastAPI(title="hloserve", docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_response(request, 400, message, param=param)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_response(request, exc.status, exc.message, type_=exc.type_, param=exc.param, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} is not allowed "
                   f"on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return _error_response(request, exc.status_code, message, type_="not_found_error" if exc.status_code == 404 else
                               "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}", type_="internal_error")

    # pure ASGI middleware (no BaseHTTPMiddleware: behind it a handler never sees the client leave)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    # -- operations ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        r = service.readiness
        if r.ready:
            return {"status": "ready", "model": service.model_name}
        status = "shutting down" if r.draining else "failed" if r.error else "warming up"
        return JSONResponse({"status": status, "detail": r.error or r.progress}, status_code=503,
                            headers={"Retry-After": RETRY_AFTER})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    apis = _apis(service)
    for api in apis:
        app.include_router(api.router)
    app.openapi = lambda: app.openapi_schema or _published(app, apis, api_key is not None)
    return app


# the routes that count against --max-pending (429) and are refused while warming up or draining (503)
ADMITTED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models/{name}:predict",
            "/v1/models/{name}/versions/{version}:predict")


def _published(app: FastAPI, apis: tuple, api_key: bool) -> dict:
    app.openapi_schema = schema.document(app, {p: m for api in apis for p, m in api.BODIES.items()},
                                         answers={p: m for api in apis for p, m in api.ANSWERS.items()},
                                         admitted=ADMITTED, api_key=api_key)
    return app.openapi_schema


class _Guard:
    """ASGI middleware: the API key on /v1/* (compared as bytes, so any header answers 401, never 500)
    and the request body bound (413 from Content-Length, or once a chunked body passes the bound)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope["path"].startswith("/v1/") and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self.key):
            return await self._reject(scope, receive, send, 401,
                                      "missing or wrong API key: send 'Authorization: Bearer KEY'", "authentication_error")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return await self._reject(scope, receive, send, 413, self._too_large(), "invalid_request_error")
        seen = 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise ApiError(413, self._too_large())
            return message

        return await self.app(scope, bounded_receive, send)

    def _too_large(self) -> str:
        return (f"request body is larger than {self.max_body} bytes; send a shorter prompt "
                f"(the server's limit is --max-body-mib)")

    async def _reject(self, scope, receive, send, status: int, message: str, type_: str) -> None:
        response = _error_response(Request(scope, receive), status, message, type_=type_)
        await response(scope, receive, send)
