"""The OpenAI API routes for LLM services: /v1/models, /v1/completions, /v1/chat/completions, and
vLLM's /tokenize and /detokenize.

Handlers are module-level functions on `router`; each reads its service from `request.app.state`.
They never touch the device: a generation request goes through http/generate.py (admit, prepare,
submit to the engine's loop thread, render), with each API's preparation and renderer in its own
module (http/completions.py, http/chat.py).
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ..config import MAX_PROMPT_CHARS_PER_TOKEN
from ..services import LLMService
from . import chat as chat_api
from . import completions as completions_api
from .errors import ApiError, check_model
from .generate import generate
from .prepare import checked_text, parse_body
from .protocol import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest)

router = APIRouter()
# the routes that parse their own body (parse_body, off the event loop): their models, for the
# published OpenAPI document (http/schema.py)
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
ANSWERS = {"/v1/completions": Completion, "/v1/chat/completions": ChatCompletion}   # their non-streamed answers


def _svc(request: Request) -> LLMService:
    return request.app.state.service


def model_card(svc: LLMService, name: str) -> dict:
    """OpenAI's Model object, with vLLM's `root` and `max_model_len` and the sampling defaults a
    request gets for the fields it leaves out (`generation_defaults`; {}: neutral)."""
    return {"id": name, "object": "model", "created": svc.created, "owned_by": "hloserve",
            "root": svc.model_names[0], "max_model_len": svc.max_model_len,
            "generation_defaults": svc.generation_defaults}


@router.get("/v1/models")
async def models(request: Request):
    svc = _svc(request)
    return {"object": "list", "data": [model_card(svc, n) for n in svc.model_names]}


@router.get("/v1/models/{name}")
async def model(name: str, request: Request):
    svc = _svc(request)
    check_model(svc, name)
    return model_card(svc, name)


@router.post("/v1/completions")
async def completions(request: Request):
    req = await parse_body(request, CompletionRequest)
    svc = _svc(request)
    check_model(svc, req.model)
    return await generate(svc, request, req, prepare=lambda: completions_api.prepare(svc, req), stream=req.stream,
                          renderer=lambda gen, choices: completions_api.CompletionRenderer(svc, req, gen, choices))


@router.post("/v1/chat/completions")
async def chat(request: Request):
    req = await parse_body(request, ChatCompletionRequest, counted=b'"role"')
    svc = _svc(request)
    check_model(svc, req.model)
    return await generate(svc, request, req, prepare=lambda: chat_api.prepare(svc, req), stream=req.stream,
                          renderer=lambda gen, choices: chat_api.ChatRenderer(svc, req, gen, choices))


@router.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's /tokenize: a prompt's (or a chat's, through the template) token ids. Parsed and tokenized
    off the event loop under the completion routes' limits (text that cannot fit the context is refused)."""
    req = await parse_body(request, TokenizeRequest)
    svc = _svc(request)
    if req.model is not None:
        check_model(svc, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send exactly one of 'prompt' and 'messages'")

    def run() -> list[int]:
        if req.prompt is not None:
            return svc.tokenizer.encode(checked_text(svc, req.prompt, "prompt"),
                                        add_special_tokens=req.add_special_tokens)
        messages = [m.for_template() for m in req.messages]
        checked_text(svc, "".join(m["content"] for m in messages), "messages")
        return svc.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt)
    try:
        ids = await asyncio.to_thread(run)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return {"tokens": ids, "count": len(ids), "max_model_len": svc.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request):
    """vLLM's /detokenize: token ids back to text (special tokens kept); at most a context's worth of
    ids times MAX_PROMPT_CHARS_PER_TOKEN, decoded off the event loop."""
    req = await parse_body(request, DetokenizeRequest)
    svc = _svc(request)
    if req.model is not None:
        check_model(svc, req.model)
    limit = svc.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    if len(req.tokens) > limit:
        raise ApiError(400, f"{len(req.tokens)} token ids; at most {limit} are decoded in one request",
                       param="tokens")
    try:
        svc.engine.check_token_ids(req.tokens)
    except ValueError as e:
        raise ApiError(400, str(e), param="tokens") from None
    return {"prompt": await asyncio.to_thread(svc.tokenizer.decode, req.tokens, skip_special_tokens=False)}
