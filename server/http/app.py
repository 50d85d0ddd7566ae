"""`create_app(service) -> FastAPI`: the OpenAI routes (http/openai.py) for LLM artifacts, TF
Serving's REST predict API (http/tf_serving.py) for the others, /health, /ready, /metrics for both,
and the error handlers that answer in each API's own format.

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
from . import openai, tf_serving
from .errors import RETRY_AFTER, ApiError
from .protocol import error_body


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


def create_app(service: LLMService | PredictService, *, api_key: str | None = None) -> FastAPI:
    """The HTTP app for one service; `api_key` guards /v1/* when given."""
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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        key = request.app.state.api_key
        if key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {key}"):
                return _error_response(request, 401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                       type_="authentication_error")
        return await call_next(request)

    app.state.api_key = api_key

    # -- operations ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        r = service.readiness
        if r.ready:
            return {"status": "ready", "model": service.model_name}
        status = "failed" if r.error else "warming up"
        return JSONResponse({"status": status, "detail": r.error or r.progress}, status_code=503,
                            headers={"Retry-After": RETRY_AFTER})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    if isinstance(service, LLMService):
        app.include_router(openai.router)
    else:
        app.include_router(tf_serving.router)
    return app
