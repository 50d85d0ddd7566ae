"""One generation request's lifecycle, the same for every API: admit, prepare, submit, render.

    admit (429/503 before any work) -> prepare (tokenize, SamplingParams and grammars on a worker
    thread, http/prepare.py) -> submit (engine streams, fan-in: http/fanin.py) -> the API's renderer:
    `answer(results)` (one typed body) or `events()` (server-sent events)

The admission is released exactly once, on every exit: here when the answer is complete or
anything fails, or by the streaming response when its stream ends (once it has been handed over).
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ..services import LLMService
from .errors import ApiError, admit
from .fanin import Choices, Finished
from .prepare import Generation, matchers, submit, warn_ignored
from .protocol import OpenModel


class Renderer(Protocol):
    """An API's answer to one request, from its choices."""

    def answer(self, results: list[Finished]) -> BaseModel:
        """The whole answer, once every choice has finished."""

    def events(self) -> AsyncIterator[str]:
        """The streamed answer as server-sent events, read from the choices as they come; leaving it
        early aborts them."""


async def generate(svc: LLMService, request: Request, req: OpenModel, *, prepare: Callable[[], Generation],
                   renderer: Callable[[Generation, Choices], Renderer], stream: bool) -> Response:
    """Admit, prepare on a worker thread (the event loop keeps serving /health and every stream),
    submit, answer through the renderer."""
    headers = warn_ignored(req)     # before admission: nothing below may fail building the answer's head
    admit(svc)
    choices: Choices | None = None
    handed_over = False
    try:
        gen, choices = await _submitted(svc, prepare)
        render = renderer(gen, choices)
        if stream:
            response = SSEResponse(render.events(), on_close=lambda: (choices.abort(), svc.admission.leave()),
                                   media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
            handed_over = True
            return response
        body = render.answer(await choices.collect(request))
        return Response(body.model_dump_json(), media_type="application/json", headers=headers)
    finally:
        if not handed_over:
            if choices is not None:
                choices.abort()
            svc.admission.leave()


async def _submitted(svc: LLMService, prepare: Callable[[], Generation]) -> tuple[Generation, Choices]:
    """Prepare on a worker thread (its grammars compiled there too), then submit; what the request
    asks that cannot run (ValueError: a bad grammar, token ids outside the vocabulary, ...) answers 400."""
    def prepared() -> tuple[Generation, list]:
        gen = prepare()
        return gen, matchers(svc, gen)

    try:
        gen, made = await asyncio.to_thread(prepared)
        return gen, submit(svc, gen, made)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def sse(body: BaseModel | dict, *, exclude: set[str] | None = None, event: str | None = None) -> str:
    """One server-sent event carrying `body` as JSON (`event:` line when named)."""
    data = body.model_dump_json(exclude=exclude) if isinstance(body, BaseModel) else json.dumps(body)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


class SSEResponse(StreamingResponse):
    """A streaming response that always releases its request when the response ends.

    Starlette leaves the body generator suspended (or never started) when the client
    disconnects, so cleanup inside it would wait for garbage collection, or never run.
    Here it runs at once, however the response ended: the generator is closed (its
    `async with choices` aborts the requests, freeing their KV blocks before the next
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
