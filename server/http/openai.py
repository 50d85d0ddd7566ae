"""The OpenAI API for LLM services: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming).

Handlers are module-level functions on `router`; each reads its service from `request.app.state`.
They never touch the device: a request is admitted, tokenized and handed to the engine's loop thread,
which streams its outputs back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import logging
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..core.outputs import FinishReason
from ..config import MAX_PROMPT_CHARS_PER_TOKEN
from ..core.sampling import SamplingParams
from ..services import LLMService
from . import tools
from .errors import SHUTTING_DOWN, ApiError, admit, check_model
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body, now

router = APIRouter()
# the routes that parse their own body (parse_body, off the event loop): their models, for the
# published OpenAPI document (http/schema.py)
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
MAX_CHAT_MESSAGES = 8192   # a chat's messages, counted from the raw body before it is parsed
log = logging.getLogger("hloserve.server")


def _svc(request: Request) -> LLMService:
    return request.app.state.service


def model_card(svc: LLMService, name: str) -> dict:
    return {"id": name, "object": "model", "created": svc.created, "owned_by": "hloserve",
            "root": svc.model_names[0], "max_model_len": svc.max_model_len}


@router.get("/v1/models")
async def models(request: Request):
    svc = _svc(request)
    return {"object": "list", "data": [model_card(svc, n) for n in svc.model_names]}


@router.get("/v1/models/{name}")
async def model(name: str, request: Request):
    svc = _svc(request)
    check_model(svc, name)
    return model_card(svc, name)


def sampling(svc: LLMService, req, prompt_len: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams: the model's generation defaults where the request is silent."""
    room = svc.max_model_len - prompt_len
    if room <= 0:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, but the model's context is {svc.max_model_len} "
                            f"tokens; shorten the prompt", param="messages" if hasattr(req, "messages") else "prompt")
    cap = svc.max_output_tokens
    if max_tokens is None:
        max_tokens = min(room if hasattr(req, "messages") else min(16, room), cap or room)
    if cap is not None and max_tokens > cap:
        raise ApiError(400, f"max_tokens={max_tokens} exceeds this server's limit of {cap} tokens per request; "
                            f"lower max_tokens", param="max_tokens")
    if max_tokens > room:
        raise ApiError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the model's "
                            f"context of {svc.max_model_len} tokens; lower max_tokens to at most {room}",
                       param="max_tokens")
    defaults = svc.generation_defaults
    top_k = req.top_k if req.top_k is not None else defaults.get("top_k")
    try:
        return SamplingParams(
            temperature=req.temperature if req.temperature is not None else defaults.get("temperature", 1.0),
            top_p=req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
            top_k=None if top_k in (None, -1, 0) else top_k, max_tokens=max_tokens, stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()), seed=req.seed, logprobs=logprobs,
            prompt_logprobs=logprobs if getattr(req, "echo", False) and req.logprobs is not None else None,
            ignore_eos=req.ignore_eos, min_p=req.min_p, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None
            else defaults.get("repetition_penalty", 1.0),
            logit_bias=req.bias_pairs(), min_tokens=min(req.min_tokens, max_tokens), structured=req.structured(),
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def checked_text(svc: LLMService, text: str, param: str) -> str:
    """Refuse text that could never fit the context, and text that is not UTF-8, before tokenizing it."""
    limit = svc.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    if len(text) > limit:
        raise ApiError(400, f"the {param} has {len(text)} characters; a context of {svc.max_model_len} tokens holds "
                            f"far fewer (limit {limit}); shorten it", param=param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the {param} is not valid Unicode text ({e.reason} at character {e.start}); "
                            f"send UTF-8 text", param=param) from None
    return text


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")   # field names written as they are; any other is JSON-quoted


def warn_ignored(req) -> dict[str, str]:
    """Response headers naming the request fields hloserve does not know (ignored, as vLLM does).

    A field name is client bytes: it goes into the header escaped to printable ASCII (JSON's escapes,
    quoted unless it is a plain name), so no name (empty, spaces, non-Latin-1, CR/LF) can break the
    header's encoding or inject a line."""
    ignored = req.ignored_fields()
    if not ignored:
        return {}
    names = ", ".join(n if _PLAIN_NAME.fullmatch(n) else json.dumps(n) for n in ignored)
    log.warning("request fields ignored (unknown to hloserve): %s", names)
    # cut to a bounded length; a header value may not end in whitespace (h11 refuses to send it)
    return {"x-hloserve-warning": f"ignored unknown fields: {names}"[:1000].rstrip()}


async def run_admitted(svc: LLMService, request: Request, req, *, chat: bool, tokenize):
    """Admit first (429/503 before any work), tokenize on a worker thread (the event loop keeps serving
    /health and every stream), enqueue, answer.

    The admission is released exactly once, on every exit: here when the answer is complete or anything
    fails, or by the streaming response when its stream ends (once it has been handed over)."""
    headers = warn_ignored(req)     # before admission: nothing below may fail building the answer's head
    admit(svc)
    streams: list = []
    handed_over = False
    try:
        prompts, max_tokens, logprobs = await asyncio.to_thread(tokenize)
        if req.truncate_prompt_tokens is not None:
            prompts = [ids[-req.truncate_prompt_tokens:] for ids in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompt_tokens = 0
        # choice p*m + i: prompt p's i-th sample (m = n, or best_of candidates of which the n most likely
        # are answered); the requests of one prompt share its cached blocks
        m = req.candidates() if not chat else req.n
        best_of = m > req.n
        for p, ids in enumerate(prompts):
            params = sampling(svc, req, len(ids), max_tokens, 0 if best_of and logprobs is None else logprobs)
            prompt_tokens += len(ids)
            for i in range(m):
                seed = None if params.seed is None else params.seed + i
                k = p * m + i
                streams.append(svc.engine.add_request(ids, dataclasses.replace(params, seed=seed),
                                                      request_id=rid if len(prompts) * m == 1 else f"{rid}-{k}"))
        echo = None
        if getattr(req, "echo", False):   # the prompt as sent (decoded when it was token ids or truncated)
            echo = [p if isinstance(p, str) and req.truncate_prompt_tokens is None else svc.tokenizer.decode(ids)
                    for p, ids in zip(req.prompts(), prompts)]
        choices = Choices(rid, streams, prompt_tokens, echo=echo, echo_ids=prompts)
        if req.stream:
            response = _stream(svc, choices, req, chat=chat, headers=headers)
            handed_over = True
            return response
        return await _answer(svc, request, choices, req, chat=chat, headers=headers)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    finally:
        if not handed_over:
            for st in streams:
                st.abort()
            svc.admission.leave()


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request body validated as `model` on a worker thread: a large JSON body (16 MiB at most)
    takes a while to parse, and the event loop keeps serving /health and every stream meanwhile."""
    body = await request.body()
    if model is ChatCompletionRequest and body.count(b'"role"') > MAX_CHAT_MESSAGES:
        # validating is pure CPU under the GIL (~2.5 us a message): bounded before it starts
        raise ApiError(400, f"more than {MAX_CHAT_MESSAGES} messages in one request", param="messages")
    try:
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _completion_ids(svc: LLMService, req: CompletionRequest):
    prompts = [svc.tokenizer.encode(checked_text(svc, p, "prompt")) if isinstance(p, str) else [int(t) for t in p]
               for p in req.prompts()]
    return prompts, req.max_tokens, req.logprobs


def _chat_ids(svc: LLMService, req: ChatCompletionRequest):
    try:
        messages = [m.for_template() for m in req.messages]
        checked_text(svc, "".join(m["content"] for m in messages), "messages")
        extra = dict(req.chat_template_kwargs or {})
        if req.uses_tools():
            extra["tools"] = req.tools
        ids = svc.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt, variables=extra)
    except ValueError as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    return [ids], req.max_completion_tokens or req.max_tokens, (req.top_logprobs or 0) if req.logprobs else None


async def _generate(request: Request, model: type[BaseModel], prompt_ids, *, chat: bool):
    req = await parse_body(request, model)
    svc = _svc(request)
    check_model(svc, req.model)
    return await run_admitted(svc, request, req, chat=chat, tokenize=lambda: prompt_ids(svc, req))


@router.post("/v1/completions")
async def completions(request: Request):
    return await _generate(request, CompletionRequest, _completion_ids, chat=False)


@router.post("/v1/chat/completions")
async def chat(request: Request):
    return await _generate(request, ChatCompletionRequest, _chat_ids, chat=True)


class Choices:
    """The n request streams of one API request, read as one: (choice index, output) as they come.
    Leaving it (`async with`), or `abort()`, aborts every request still running."""

    def __init__(self, request_id: str, streams: list, prompt_tokens: int, echo: list[str] | None = None,
                 echo_ids: list | None = None):
        self.request_id = request_id
        self.streams = streams
        self.prompt_tokens = prompt_tokens     # all prompts of the request, each counted once
        self.echo = echo                       # per prompt, its text (completions' echo)
        self.echo_ids = echo_ids               # per prompt, its token ids
        self.prompt_logprobs: dict[int, tuple] = {}   # per prompt: its tokens' logprobs, once computed

    def echoed_logprobs(self, svc, choice: int, lps: list) -> dict:
        """Completions' logprobs of a choice: with echo, its prompt's tokens first (the first one has
        no logprob, as OpenAI's), then the generated ones."""
        p = self.prompt_of(choice)
        if not self.echo or p not in self.prompt_logprobs:
            return _completion_logprobs(svc, lps)
        return _completion_logprobs(svc, lps, prompt=(self.echo_ids[p][0], self.prompt_logprobs[p]))

    def prompt_of(self, choice: int) -> int:
        return choice * len(self.echo) // len(self.streams) if self.echo else 0

    def abort(self) -> None:
        for st in self.streams:
            st.abort()

    async def __aenter__(self) -> "Choices":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    async def __aiter__(self):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, st):
            try:
                async for out in st:
                    await queue.put((i, out))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(self.streams)]
        try:
            open_ = len(tasks)
            while open_:
                i, out = await queue.get()
                if out is None:
                    open_ -= 1
                else:
                    if out.prompt_logprobs is not None:
                        self.prompt_logprobs[self.prompt_of(i)] = out.prompt_logprobs
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()


def _stream(svc: LLMService, choices: Choices, req, *, chat: bool, headers: dict) -> "_SSEResponse":
    """The streaming answer; it owns the admission from here and releases it when the stream ends."""
    rid = choices.request_id if not chat else "chat" + choices.request_id
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    gen = _sse(svc, choices, rid, now(), req, chat=chat, include_usage=include_usage)
    return _SSEResponse(gen, on_close=lambda: (choices.abort(), svc.admission.leave()),
                        media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})


async def _answer(svc: LLMService, request: Request, choices: Choices, req, *, chat: bool, headers: dict):
    """The whole answer at once, once every choice has finished."""
    rid = choices.request_id if not chat else "chat" + choices.request_id
    created = now()
    results = await _collect(request, choices)
    lasts = [last for _, _, last in results]
    for last in lasts:
        if last is not None and last.finish_reason is FinishReason.ERROR:
            if last.error == SHUTTING_DOWN:
                raise ApiError(503, SHUTTING_DOWN, type_="service_unavailable", headers={"Retry-After": "1"})
            raise ApiError(500, f"generation failed: {last.error}", type_="internal_error")
    if not chat and req.candidates() > req.n:
        results = _best(results, req.candidates(), req.n, keep_logprobs=req.logprobs is not None)
    out = []
    for i, (text, lps, last) in enumerate(results):
        reason = last.finish_reason if last else "abort"
        if choices.echo:
            text = choices.echo[i * len(choices.echo) // len(results)] + text
        if chat:
            message: dict = {"role": "assistant", "content": text}
            if req.uses_tools():
                message["content"], calls = tools.parse(text, req.tools, req.tool_choice)
                if calls:
                    message["tool_calls"] = [c.to_json() for c in calls]
                    reason = "tool_calls" if reason == FinishReason.STOP else reason
            out.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": _chat_logprobs(svc, lps) if req.logprobs else None})
        else:
            out.append({"index": i, "text": text, "finish_reason": reason,
                        "logprobs": choices.echoed_logprobs(svc, i, lps) if req.logprobs is not None else None})
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": req.model, "choices": out, "usage": _usage(lasts, choices.prompt_tokens)}
    return JSONResponse(body, headers=headers)


def _best(results: list, m: int, n: int, *, keep_logprobs: bool) -> list:
    """best_of: of each prompt's m candidates, the n with the highest log-probability (the sum over
    their tokens), most likely first."""
    out = []
    for p in range(0, len(results), m):
        group = sorted(results[p:p + m], key=lambda r: -sum(lp.logprob for lp in r[1]))[:n]
        out += [(text, lps if keep_logprobs else [], last) for text, lps, last in group]
    return out


async def _collect(request: Request, choices: Choices) -> list[tuple[str, list, object]]:
    """Drain the choices for a non-streaming answer: (text, logprobs, last output) per choice; a client
    disconnect aborts them."""
    async def watch():
        while True:
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                choices.abort()
                return

    watcher = asyncio.create_task(watch())
    texts = [[] for _ in choices.streams]
    lps = [[] for _ in choices.streams]
    lasts: list = [None] * len(choices.streams)
    try:
        async with choices:
            async for i, out in choices:
                texts[i].append(out.new_text)
                lps[i].extend(out.logprobs or ())
                lasts[i] = out
    finally:
        watcher.cancel()
    return [("".join(t), lp, last) for t, lp, last in zip(texts, lps, lasts)]


def _usage(lasts: list, prompt: int) -> dict:
    """Each prompt counted once (its n choices share it), the completions summed."""
    completion = sum(o.num_output_tokens for o in lasts if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_str(svc, tid: int) -> str:
    return svc.tokenizer.decode([tid], skip_special_tokens=False)


def _completion_logprobs(svc, lps, *, prompt: tuple | None = None) -> dict:
    """OpenAI's completions logprobs; `prompt` (its first token id, the logprobs of the others) puts
    the echoed prompt's tokens first."""
    entries = [(lp.token_id, lp) for lp in lps]                          # (token id, its logprobs or None)
    if prompt is not None:
        first, rest = prompt
        entries = [(first, None)] + [(lp.token_id, lp) for lp in rest] + entries
    tokens = [_token_str(svc, t) for t, _ in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
            "top_logprobs": [None if lp is None else {_token_str(svc, t): v for t, v in lp.top} for _, lp in entries],
            "text_offset": offsets}


def _chat_logprobs(svc, lps) -> dict:
    def entry(tid, v):
        s = _token_str(svc, tid)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}
    return {"content": [dict(entry(lp.token_id, lp.logprob),
                             top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in lps]}


async def _sse(svc, choices: Choices, rid, created, req, *, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format (each chunk names its choice index), ending with
    `data: [DONE]`."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict, usage: dict | None = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": req.model,
                "choices": [choice] if choice else []}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    lasts: list = [None] * len(choices.streams)
    held = [[] for _ in choices.streams]      # with tools: the text, parsed when the choice ends
    with_tools = chat and req.uses_tools()
    async with choices:   # leaving early (client disconnect -> cancellation) aborts the requests
        if chat:
            for i in range(len(choices.streams)):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        elif choices.echo and req.logprobs is None:
            for i in range(len(choices.streams)):
                yield chunk({"index": i, "text": choices.echo[choices.prompt_of(i)], "logprobs": None,
                             "finish_reason": None})
        echoed: set[int] = set()   # echo with logprobs: each prompt's chunk waits for its logprobs
        async for i, out in choices:
            lasts[i] = out
            if choices.echo and req.logprobs is not None and i not in echoed:
                echoed.add(i)
                yield chunk({"index": i, "text": choices.echo[choices.prompt_of(i)], "finish_reason": None,
                             "logprobs": choices.echoed_logprobs(svc, i, [])})
            if out.finish_reason is FinishReason.ERROR:
                yield f"data: {json.dumps(error_body(f'generation failed: {out.error}', type_='internal_error'))}\n\n"
                break
            lps = list(out.logprobs or ())
            reason = out.finish_reason if out.finished else None
            if not out.new_text and not reason and not lps:
                continue
            if with_tools:
                held[i].append(out.new_text)
                if not reason:
                    continue
                content, calls = tools.parse("".join(held[i]), req.tools, req.tool_choice)
                delta: dict = {}
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [c.to_json(index=k) for k, c in enumerate(calls)]
                    reason = "tool_calls" if reason == FinishReason.STOP else reason
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
            elif chat:
                choice = {"index": i, "delta": {"content": out.new_text} if out.new_text else {},
                          "logprobs": _chat_logprobs(svc, lps) if (req.logprobs and lps) else None,
                          "finish_reason": reason}
            else:
                choice = {"index": i, "text": out.new_text, "finish_reason": reason,
                          "logprobs": _completion_logprobs(svc, lps) if req.logprobs is not None and lps else None}
            yield chunk(choice)
        if include_usage:
            yield chunk({}, _usage(lasts, choices.prompt_tokens))
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
