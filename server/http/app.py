"""`create_app(service) -> FastAPI`: the OpenAI APIs (`LLM_APIS`) for LLM artifacts, TF Serving's REST predict
API (http/tf_serving.py, and /v1/embeddings for encoders) for the others, /health, /ready, /metrics for both,
and the error handlers that answer in each API's own format.

One middleware (`_Guard`) stands in front of every route, so a route added later is covered without
doing anything: with an API key, every path but `open_paths()` answers 401 without it (unknown paths
included: nothing about the routes is told to a client without the key), and every request body is
read within its budgets (http/bodies.py).

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
from . import chat, completions, embeddings, lora, models, responses, schema, tf_serving, tokenization
from .bodies import BodyLimits, BodyReader, too_large
from .errors import RETRY_AFTER, ApiError
from .protocol import error_body

# answered without the API key: load balancers' and orchestrators' probes, and the metrics scraper
# (unless --metrics-require-key)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})

# the API modules each service serves, in route order
LLM_APIS = (models, completions, chat, tokenization, responses, lora)
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


def open_paths(*, metrics_require_key: bool = False) -> frozenset[str]:
    """The paths answered without the API key: the probes, and /metrics unless `metrics_require_key`."""
    return OPEN_PATHS - {"/metrics"} if metrics_require_key else OPEN_PATHS


def create_app(service: LLMService | PredictService, *, api_key: str | None = None,
               limits: BodyLimits = BodyLimits(), metrics_require_key: bool = False) -> FastAPI:
    """The HTTP app for one service. With `api_key`, every route but `open_paths()` needs it; request
    bodies are read within `limits` (http/bodies.py)."""
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
    public = open_paths(metrics_require_key=metrics_require_key)
    app.add_middleware(_Guard, api_key=api_key, open_paths=public, limits=limits)

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
    app.openapi = lambda: app.openapi_schema or _published(app, apis, public if api_key is not None else None)
    return app


# the routes that count against --max-pending (429) and are refused while warming up or draining (503)
ADMITTED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models/{name}:predict",
            "/v1/models/{name}/versions/{version}:predict")


def _published(app: FastAPI, apis: tuple, public: frozenset[str] | None) -> dict:
    app.openapi_schema = schema.document(app, {p: m for api in apis for p, m in api.BODIES.items()},
                                         answers={p: m for api in apis for p, m in api.ANSWERS.items()},
                                         admitted=ADMITTED, open_paths=public)
    return app.openapi_schema


class _Guard:
    """ASGI middleware, the one rule every route passes: the API key on every path but the open ones
    (compared as bytes, so any header answers 401, never 500), then the body budgets (413 from
    Content-Length before anything is read; bytes, chunks and the deadline as the body arrives,
    http/bodies.py)."""

    def __init__(self, app, *, api_key: str | None, open_paths: frozenset[str], limits: BodyLimits):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = open_paths
        self.limits = limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        reader = BodyReader(scope, receive, send, self.limits)
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope["path"] not in self.open_paths and \
                not secrets.compare_digest(headers.get(b"authorization", b""), self.key):
            return await self._reject(scope, reader, 401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                      "authentication_error", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limits.max_bytes:
            return await self._reject(scope, reader, 413, too_large(self.limits.max_bytes), "invalid_request_error")
        return await self.app(scope, reader.receive, reader.send)

    @staticmethod
    async def _reject(scope, reader: BodyReader, status: int, message: str, type_: str,
                      headers: dict | None = None) -> None:
        response = _error_response(Request(scope, reader.receive), status, message, type_=type_, headers=headers)
        await response(scope, reader.receive, reader.send)
