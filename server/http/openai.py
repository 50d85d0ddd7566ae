"""The OpenAI API for LLM services: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming).

Handlers are module-level functions on `router`; each reads its service from `request.app.state`.
They never touch the device: a request is admitted, tokenized and handed to the engine's loop thread,
which streams its outputs back.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..core.outputs import FinishReason
from ..core.sampling import SamplingParams
from ..services import LLMService
from .errors import ApiError, admit
from .protocol import ChatCompletionRequest, CompletionRequest, error_body, now

router = APIRouter()


def _svc(request: Request) -> LLMService:
    return request.app.state.service


def model_card(svc: LLMService) -> dict:
    return {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "hloserve",
            "max_model_len": svc.max_model_len}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(_svc(request))]}


@router.get("/v1/models/{name}")
async def model(name: str, request: Request):
    svc = _svc(request)
    check_model(svc, name)
    return model_card(svc)


def check_model(svc: LLMService, name: str) -> None:
    if name != svc.model_name:
        raise ApiError(404, f"model '{name}' does not exist; this server serves '{svc.model_name}'",
                       type_="not_found_error", param="model")


def sampling(svc: LLMService, req, prompt_len: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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


def start(svc: LLMService, ids: list[int], params: SamplingParams):
    """Admit (429/503 past the limits) and enqueue; the admission is released if enqueueing fails."""
    admit(svc)
    try:
        return svc.engine.add_request(ids, params, request_id=f"cmpl-{uuid.uuid4().hex}")
    except ValueError as e:
        svc.admission.leave()
        raise ApiError(400, str(e)) from None
    except BaseException:
        svc.admission.leave()
        raise


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    svc = _svc(request)
    check_model(svc, req.model)
    if isinstance(req.prompt, str):
        ids = svc.tokenizer.encode(req.prompt)
    else:
        ids = [int(t) for t in req.prompt]
    params = sampling(svc, req, len(ids), req.max_tokens, req.logprobs)
    stream = start(svc, ids, params)
    return await _respond(svc, request, stream, req, chat=False)


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, request: Request):
    svc = _svc(request)
    check_model(svc, req.model)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = svc.tokenizer.encode_chat(messages)
    except ValueError as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling(svc, req, len(ids), req.max_completion_tokens or req.max_tokens, k)
    stream = start(svc, ids, params)
    return await _respond(svc, request, stream, req, chat=True)


async def _respond(svc: LLMService, request: Request, stream, req, *, chat: bool):
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
