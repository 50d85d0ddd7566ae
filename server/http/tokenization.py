"""vLLM's tokenization API (POST /tokenize, /detokenize) for LLM services: prompt or chat -> token
ids, and back (wire models: http/tokenization_protocol.py).

Each route parses its body off the event loop (prepare.parse_body) and works on a worker thread
under the completion routes' limits; neither is admitted (no generation, no device).
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ..config import MAX_PROMPT_CHARS_PER_TOKEN
from ..services import LLMService
from .errors import ApiError, check_model
from .prepare import checked_text, parse_body
from .tokenization_protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()
BODIES = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}   # parsed by the routes, for /openapi.json
ANSWERS: dict = {}                                                          # untyped answers


@router.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's /tokenize: a prompt's (or a chat's, through the template) token ids. Parsed and tokenized
    off the event loop under the completion routes' limits (text that cannot fit the context is refused)."""
    req = await parse_body(request, TokenizeRequest)
    svc: LLMService = request.app.state.service
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
    svc: LLMService = request.app.state.service
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
