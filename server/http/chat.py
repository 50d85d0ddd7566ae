"""The chat completions API (POST /v1/chat/completions) for LLM services: its route, preparation and
renderer (wire models: http/chat_protocol.py).

The route parses the body off the event loop (its messages counted first) and runs the generation
path (http/generate.py: admit, prepare, submit, render). Preparation renders the messages (and
the tools) through the model's chat template. Rendering: with tools, each choice's text is parsed
for calls when it ends (http/tools.py), so a streamed answer with tools sends its content and
calls as one delta at the end; without, text streams as it comes.
"""
from __future__ import annotations

from typing import Iterator

from fastapi import APIRouter, Request

from ..core.outputs import FinishReason, RequestOutput
from ..core.sampling import TokenLogprobs
from ..services import LLMService
from . import tools
from .chat_protocol import (AssistantMessage, CalledFunction, CalledTool, ChatChoice, ChatChunkChoice, ChatCompletion,
                            ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatLogprobs, ChatTokenLogprob,
                            ChatTopLogprob)
from .chunks import ChunkStream, token_str, usage
from .errors import ApiError, check_model
from .fanin import Choices, Finished
from .generate import generate
from .prepare import Generation, encode_chat, openai_generation, parse_body

router = APIRouter()
BODIES = {"/v1/chat/completions": ChatCompletionRequest}   # the body its route parses itself, for /openapi.json
ANSWERS = {"/v1/chat/completions": ChatCompletion}          # its answer (not streamed), for /openapi.json


@router.post("/v1/chat/completions")
async def chat(request: Request):
    req = await parse_body(request, ChatCompletionRequest, counted=b'"role"')
    svc: LLMService = request.app.state.service
    check_model(svc, req.model)
    return await generate(svc, request, req, prepare=lambda: prepare(svc, req), stream=req.stream,
                          renderer=lambda gen, choices: ChatRenderer(svc, req, gen, choices))


def prepare(svc: LLMService, req: ChatCompletionRequest) -> Generation:
    try:
        messages = [m.for_template() for m in req.messages]
    except ValueError as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    extra = dict(req.chat_template_kwargs or {})
    if req.uses_tools():
        extra["tools"] = req.tools
    ids = encode_chat(svc, messages, add_generation_prompt=req.add_generation_prompt, variables=extra)
    return openai_generation(svc, req, [ids], max_tokens=req.max_completion_tokens or req.max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None, samples=req.n,
                             default=None, prompt_param="messages")


def called(calls: list[tools.ToolCall], *, streamed: bool = False) -> list[CalledTool]:
    """Parsed tool calls as the answer carries them (a streamed delta numbers them)."""
    return [CalledTool(index=k if streamed else None, id=c.id, function=CalledFunction(name=c.name,
                                                                                       arguments=c.arguments))
            for k, c in enumerate(calls)]


class ChatRenderer(ChunkStream):
    """A chat request's answer (`ChatCompletion`), whole or as `ChatCompletionChunk`s."""

    def __init__(self, svc: LLMService, req: ChatCompletionRequest, gen: Generation, choices: Choices):
        super().__init__(svc, req, choices, "chat" + choices.request_id)
        self.with_tools = req.uses_tools()
        self._held: list[list[str]] = [[] for _ in range(len(choices))]   # with tools: text, parsed at the end

    # -- whole ----------------------------------------------------------------------------------
    def answer(self, results: list[Finished]) -> ChatCompletion:
        req = self.req
        out = []
        for i, r in enumerate(results):
            reason = r.finish_reason
            message = AssistantMessage(content=r.text)
            if self.with_tools:
                content, calls = tools.parse(r.text, req.tools, req.tool_choice)
                message = AssistantMessage(content=content, tool_calls=called(calls) or None)
                if calls and reason == FinishReason.STOP:
                    reason = "tool_calls"
            out.append(ChatChoice(index=i, message=message, finish_reason=reason,
                                  logprobs=self.logprobs(r.logprobs) if req.logprobs else None))
        return ChatCompletion(id=self.request_id, created=self.created, model=req.model, choices=out,
                              usage=usage(self.choices.prompt_tokens, [r.last for r in results]))

    # -- streamed -------------------------------------------------------------------------------
    def body(self, choices: list, usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.req.model, choices=choices,
                                   usage=usage)

    def opening(self) -> Iterator[ChatChunkChoice]:
        for i in range(len(self.choices)):
            yield ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                                  finish_reason=None)

    def chunk(self, i: int, out: RequestOutput, logprobs: list, reason: FinishReason | None) -> ChatChunkChoice | None:
        if not self.with_tools:
            return ChatChunkChoice(index=i, delta=ChatDelta(content=out.new_text) if out.new_text else ChatDelta(),
                                   logprobs=self.logprobs(logprobs) if (self.req.logprobs and logprobs) else None,
                                   finish_reason=reason)
        self._held[i].append(out.new_text)
        if not reason:
            return None
        content, calls = tools.parse("".join(self._held[i]), self.req.tools, self.req.tool_choice)
        delta = ChatDelta(content=content or None, tool_calls=called(calls, streamed=True) or None)
        if calls and reason == FinishReason.STOP:
            reason = "tool_calls"
        return ChatChunkChoice(index=i, delta=delta, logprobs=None, finish_reason=reason)

    # -- logprobs -------------------------------------------------------------------------------
    def logprobs(self, lps: list[TokenLogprobs]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            s = token_str(self.svc, token_id)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(lp.token_id, lp.logprob),
                             top_logprobs=[ChatTopLogprob(**entry(t, v)) for t, v in lp.top]) for lp in lps])
