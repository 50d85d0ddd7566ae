"""`create_app(service) -> FastAPI`: OpenAI routes for LLM artifacts, TF Serving's REST
predict API for the others, and /health, /ready, /metrics for both.

Handlers never touch the device: LLM requests go to the engine's loop thread
(`engine.add_request` returns a stream), predict requests to the batcher's
worker. A client that disconnects aborts its request at once (the stream's
context manager), so its KV blocks are freed before the next step. Every
error answers in the API's own format (OpenAI's {"error": {...}} or TF
Serving's {"error": "..."}) and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import ChatCompletionRequest, CompletionRequest, error_body, now
from ..core.outputs import FinishReason
from ..services import LLMService, PredictService

RETRY_AFTER = "1"


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        self.status, self.message, self.type_, self.param, self.headers = status, message, type_, param, headers


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
        _add_openai_routes(app, service)
    else:
        _add_predict_routes(app, service)
    return app


def _admit(service) -> None:
    if not service.readiness.ready:
        raise ApiError(503, "the model is warming up; retry shortly" if not service.readiness.error
                       else f"the model failed to load: {service.readiness.error}", type_="service_unavailable",
                       headers={"Retry-After": RETRY_AFTER})
    if not service.admission.try_enter():
        raise ApiError(429, f"server overloaded: {service.admission.limit} requests in flight; retry later",
                       type_="rate_limit_error", headers={"Retry-After": RETRY_AFTER})


# -- OpenAI ------------------------------------------------------------------------
def _add_openai_routes(app: FastAPI, svc: LLMService) -> None:
    from ..core.sampling import SamplingParams

    def model_card() -> dict:
        return {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "hloserve",
                "max_model_len": svc.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != svc.model_name:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{svc.model_name}'",
                           type_="not_found_error", param="model")
        return model_card()

    def check_model(name: str) -> None:
        if name != svc.model_name:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{svc.model_name}'",
                           type_="not_found_error", param="model")

    def sampling(req, prompt_len: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        room = svc.max_model_len - prompt_len
        if room <= 0:
            raise ApiError(400, f"the prompt has {prompt_len} tokens, but the model's context is {svc.max_model_len} "
                                f"tokens; shorten the prompt", param="messages" if hasattr(req, "messages") else "prompt")
        if max_tokens is None:
            max_tokens = room if hasattr(req, "messages") else min(16, room)
        if max_tokens > room:
            raise ApiError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the model's "
                                f"context of {svc.max_model_len} tokens; lower max_tokens to at most {room}",
                           param="max_tokens")
        top_k = None if req.top_k in (None, -1, 0) else req.top_k
        try:
            return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=top_k, max_tokens=max_tokens,
                                  stop=tuple(req.stop or ()), seed=req.seed, logprobs=logprobs, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def start(ids: list[int], params: SamplingParams):
        """Admit (429/503 past the limits) and enqueue; the admission is released if enqueueing fails."""
        _admit(svc)
        try:
            return svc.engine.add_request(ids, params, request_id=f"cmpl-{uuid.uuid4().hex}")
        except ValueError as e:
            svc.admission.leave()
            raise ApiError(400, str(e)) from None
        except BaseException:
            svc.admission.leave()
            raise

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        if isinstance(req.prompt, str):
            ids = svc.tokenizer.encode(req.prompt)
        else:
            ids = [int(t) for t in req.prompt]
        params = sampling(req, len(ids), req.max_tokens, req.logprobs)
        stream = start(ids, params)
        return await _respond(request, stream, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = svc.tokenizer.encode_chat(messages)
        except ValueError as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling(req, len(ids), req.max_completion_tokens or req.max_tokens, k)
        stream = start(ids, params)
        return await _respond(request, stream, req, chat=True)

    async def _respond(request: Request, stream, req, *, chat: bool):
        rid = stream.request_id if not chat else "chat" + stream.request_id
        created = now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = _sse(svc, stream, rid, created, req, chat=chat, include_usage=include_usage)
            return _SSEResponse(gen, on_close=lambda: (stream.abort(), svc.admission.leave()),
                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            text, toks, lps, last = await _collect(request, stream)
        finally:
            svc.admission.leave()
        if last is not None and last.finish_reason is FinishReason.ERROR:
            raise ApiError(500, f"generation failed: {last.error}", type_="internal_error")
        usage = _usage(last)
        reason = last.finish_reason if last else "abort"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": _chat_logprobs(svc, lps) if req.logprobs else None}
            return {"id": rid, "object": "chat.completion", "created": created, "model": svc.model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": reason,
                  "logprobs": _completion_logprobs(svc, lps) if req.logprobs is not None else None}
        return {"id": rid, "object": "text_completion", "created": created, "model": svc.model_name,
                "choices": [choice], "usage": usage}


async def _collect(request: Request, stream):
    """Drain a stream for a non-streaming answer; a client disconnect aborts the request."""
    async def watch():
        while True:
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                stream.abort()
                return

    watcher = asyncio.create_task(watch())
    text, toks, lps, last = [], [], [], None
    try:
        async with stream:
            async for out in stream:
                text.append(out.new_text)
                toks.extend(out.new_token_ids)
                lps.extend(out.logprobs or ())
                last = out
    finally:
        watcher.cancel()
    return "".join(text), toks, lps, last


def _usage(out) -> dict:
    if out is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}


def _token_str(svc, tid: int) -> str:
    return svc.tokenizer.decode([tid], skip_special_tokens=False)


def _completion_logprobs(svc, lps) -> dict:
    tokens = [_token_str(svc, lp.token_id) for lp in lps]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_str(svc, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def _chat_logprobs(svc, lps) -> dict:
    def entry(tid, v):
        s = _token_str(svc, tid)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}
    return {"content": [dict(entry(lp.token_id, lp.logprob),
                             top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in lps]}


async def _sse(svc, stream, rid, created, req, *, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict, usage: dict | None = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": svc.model_name,
                "choices": [choice] if choice else []}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    last = None
    async with stream:   # leaving early (client disconnect -> cancellation) aborts the request
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async for out in stream:
            last = out
            if out.finish_reason is FinishReason.ERROR:
                yield f"data: {json.dumps(error_body(f'generation failed: {out.error}', type_='internal_error'))}\n\n"
                break
            lps = list(out.logprobs or ())
            reason = out.finish_reason if out.finished else None
            if not out.new_text and not reason and not lps:
                continue
            if chat:
                choice = {"index": 0, "delta": {"content": out.new_text} if out.new_text else {},
                          "logprobs": _chat_logprobs(svc, lps) if (req.logprobs and lps) else None,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": out.new_text, "finish_reason": reason,
                          "logprobs": _completion_logprobs(svc, lps) if req.logprobs is not None and lps else None}
            yield chunk(choice)
        if include_usage:
            yield chunk({}, _usage(last))
        yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """A streaming response that always releases its request when the response ends.

    Starlette leaves the body generator suspended (or never started) when the client
    disconnects, so cleanup inside it would wait for garbage collection, or never run.
    Here it runs at once, however the response ended: the generator is closed (its
    `async with stream` aborts the request, freeing its KV blocks before the next
    step) and `on_close` releases the admission slot.
    """

    def __init__(self, content, *, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()


# -- TF Serving --------------------------------------------------------------------
def _add_predict_routes(app: FastAPI, svc: PredictService) -> None:
    import numpy as np

    from hloserve.runtime.artifact.errors import HloserveError

    from .tf_serving_protocol import PredictRequestError, decode_predict_request, encode_predict_response

    def check(name: str, version: str | None) -> None:
        if name != svc.model_name:
            raise ApiError(404, f"Servable not found for request: Latest({name}); this server serves '{svc.model_name}'")
        if version is not None and version != str(svc.version):
            raise ApiError(404, f"Servable not found for request: Specific({name}, {version}); "
                                f"available version: {svc.version}")

    async def predict(name: str, version: str | None, request: Request):
        check(name, version)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        try:
            req = decode_predict_request(body, svc.model.manifest)
        except PredictRequestError as e:
            raise ApiError(400, str(e)) from None
        _admit(svc)
        try:
            outs = await svc.batcher.run(req.function, req.inputs)
        except HloserveError as e:
            raise ApiError(400, str(e)) from None
        finally:
            svc.admission.leave()
        return JSONResponse(encode_predict_response({k: np.asarray(v) for k, v in outs.items()}, req))

    @app.post("/v1/models/{name}:predict")
    async def predict_latest(name: str, request: Request):
        return await predict(name, None, request)

    @app.post("/v1/models/{name}/versions/{version}:predict")
    async def predict_version(name: str, version: str, request: Request):
        return await predict(name, version, request)

    def status() -> dict:
        state = "AVAILABLE" if svc.readiness.ready else ("END" if svc.readiness.error else "LOADING")
        return {"model_version_status": [{"version": str(svc.version), "state": state,
                                          "status": {"error_code": "OK", "error_message": svc.readiness.error or ""}}]}

    @app.get("/v1/models/{name}")
    @app.get("/v1/models/{name}/versions/{version}")
    async def model_status(name: str, version: str | None = None):
        check(name, version)
        return status()

    def metadata() -> dict:
        return {"model_spec": {"name": svc.model_name, "signature_name": "", "version": str(svc.version)},
                "metadata": {"signature_def": _signature_defs(svc.model.manifest)}}

    @app.get("/v1/models/{name}/metadata")
    @app.get("/v1/models/{name}/versions/{version}/metadata")
    async def model_metadata(name: str, version: str | None = None):
        check(name, version)
        return metadata()


_TF_DTYPES = {"f32": "DT_FLOAT", "f16": "DT_HALF", "bf16": "DT_BFLOAT16", "i32": "DT_INT32", "i16": "DT_INT16",
              "i8": "DT_INT8", "u8": "DT_UINT8", "bool": "DT_BOOL", "u32": "DT_UINT32"}


def _signature_defs(manifest) -> dict:
    """GetModelMetadata's signature_def map, as TF Serving answers it (symbolic dims are -1)."""
    from .tf_serving_protocol import default_function

    def tensors(specs):
        return {t.name: {"dtype": _TF_DTYPES.get(t.dtype, "DT_INVALID"), "name": t.name,
                         "tensor_shape": {"dim": [{"size": str(d if isinstance(d, int) else -1), "name": ""}
                                                  for d in t.shape], "unknown_rank": False}} for t in specs}

    sigs = {}
    for name, fn in manifest.functions.items():
        sig = {"inputs": tensors(fn.inputs), "outputs": tensors(fn.outputs), "method_name": "tensorflow/serving/predict"}
        sigs[name] = sig
        if name == default_function(manifest):
            sigs["serving_default"] = sig
    return {"signature_def": sigs}
