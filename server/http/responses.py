"""OpenAI's Responses API (POST /v1/responses) for LLM services: its route, preparation and renderer
(wire models: http/responses_protocol.py).

A response is a chat underneath, through the same path as /v1/chat/completions: `instructions` and
`input` become the conversation the model's chat template renders (so the same greedy request gives
the same tokens on both routes), `text.format` and a forced `tool_choice` become the grammar on the
output (server/text/grammar.py), function tools are rendered by the template and calls parsed
from the finished text (http/tools.py). One prompt, one sample: the engine's single stream is read
through the fan-in (http/fanin.py) like any other.

Streamed, the events are the SDK's: response.created, response.in_progress, then per output item
output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done (a function_call item: function_call_arguments.delta and .done), and last
response.completed (response.incomplete when max_output_tokens cut the answer, response.failed
when the engine failed). With tools the text is held until the answer ends, as chat's stream does:
calls are parsed from the whole output.

Nothing is stored: `previous_response_id` answers 400 (see http/responses_protocol.py).
"""
from __future__ import annotations

import itertools
import uuid
from typing import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from pydantic import BaseModel

from ..core.outputs import FinishReason, RequestOutput
from ..services import LLMService
from . import tools
from .errors import check_model
from .fanin import Choices, Finished
from .generate import generate, sse
from .prepare import Generation, encode_chat, output_budget, parse_body, sampling_params
from .protocol import now
from .responses_protocol import (ArgumentsDeltaEvent, ArgumentsDoneEvent, ContentPartEvent, FunctionCall,
                                 IncompleteDetails, InputTokensDetails, OutputItemEvent, OutputMessage, OutputText,
                                 Response, ResponseError, ResponseLifecycleEvent, ResponsesRequest, ResponseUsage,
                                 TextConfig, TextDeltaEvent, TextDoneEvent, TextFormat)

router = APIRouter()
BODIES = {"/v1/responses": ResponsesRequest}   # the body its route parses itself, for /openapi.json
ANSWERS = {"/v1/responses": Response}          # its answer (not streamed), for /openapi.json


@router.post("/v1/responses")
async def create_response(request: Request):
    req = await parse_body(request, ResponsesRequest, counted=b'"role"')
    svc: LLMService = request.app.state.service
    check_model(svc, req.model)
    return await generate(svc, request, req, prepare=lambda: prepare(svc, req), stream=req.stream,
                          renderer=lambda gen, choices: ResponsesRenderer(req, choices))


def prepare(svc: LLMService, req: ResponsesRequest) -> Generation:
    ids = encode_chat(svc, req.messages(), variables={"tools": req.chat_tools()} if req.uses_tools() else None,
                      param="input")
    budget = output_budget(svc, len(ids), req.max_output_tokens, default=None, prompt_param="input",
                           name="max_output_tokens")
    params = sampling_params(svc, temperature=req.temperature, top_p=req.top_p, max_tokens=budget,
                             structured=req.structured(), adapter=svc.adapter_ref(req.model))
    return Generation(prompts=[ids], params=[params])


def _hex() -> str:
    return uuid.uuid4().hex


class ResponsesRenderer:
    """A Responses request's answer: one `Response`, or its events."""

    def __init__(self, req: ResponsesRequest, choices: Choices):
        self.req, self.choices = req, choices
        self.id = f"resp_{choices.request_id.removeprefix('cmpl-')}"
        self.created = now()
        self._seq = itertools.count()

    def response(self, status: str, output: list, last: RequestOutput | None = None,
                 error: str | None = None) -> Response:
        req = self.req
        usage = None if last is None else ResponseUsage(
            input_tokens=self.choices.prompt_tokens, output_tokens=last.num_output_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=last.num_cached_tokens),
            total_tokens=self.choices.prompt_tokens + last.num_output_tokens)
        return Response(
            id=self.id, created_at=self.created, model=req.model, status=status, output=output, usage=usage,
            error=ResponseError(message=error) if error else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, tools=req.tools or [], tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text if req.text is not None and req.text.format is not None else TextConfig(format=TextFormat()),
            metadata=req.metadata or {}, user=req.user)

    def output(self, text: str, status: str) -> list:
        """The answer's output items: its message, or with tools (when calls were parsed) any text
        content, then one function_call item per call (at most max_tool_calls)."""
        if self.req.uses_tools():
            content, calls = tools.parse(text, self.req.chat_tools(), self.req.chat_tool_choice())
            if calls:
                items: list = [self.message(content, "completed")] if content else []
                return items + [FunctionCall(id=f"fc_{_hex()}", call_id=c.id, name=c.name, arguments=c.arguments,
                                             status="completed") for c in calls[:self.req.max_tool_calls]]
        return [self.message(text, status)]

    def message(self, text: str, status: str) -> OutputMessage:
        return OutputMessage(id=f"msg_{self.id.removeprefix('resp_')}", status=status, content=[OutputText(text=text)])

    @staticmethod
    def status(last: RequestOutput | None) -> tuple[str, str | None]:
        """(status, error) of a finished answer."""
        if last is None or last.finish_reason is FinishReason.ABORT:
            return "failed", "the request was aborted before it finished"
        if last.finish_reason is FinishReason.ERROR:
            return "failed", f"generation failed: {last.error}"
        return ("incomplete" if last.finish_reason is FinishReason.LENGTH else "completed"), None

    # -- whole ----------------------------------------------------------------------------------
    def answer(self, results: list[Finished]) -> Response:
        (r,) = results
        status, error = self.status(r.last)
        return self.response(status, [] if error else self.output(r.text, status), r.last, error)

    # -- streamed -------------------------------------------------------------------------------
    def _event(self, model: type[BaseModel], **fields) -> str:
        event = model(sequence_number=next(self._seq), **fields)
        return sse(event, event=event.type)

    def _lifecycle(self, type_: str, response: Response) -> str:
        return self._event(ResponseLifecycleEvent, type=type_, response=response)

    def _opened(self, index: int, item) -> Iterator[str]:
        """An item's opening events (a message with its empty text part)."""
        if isinstance(item, OutputMessage):
            yield self._event(OutputItemEvent, type="response.output_item.added", output_index=index,
                              item=item.model_copy(update={"status": "in_progress", "content": []}))
            yield self._event(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                              output_index=index, content_index=0, part=OutputText(text=""))
        else:
            yield self._event(OutputItemEvent, type="response.output_item.added", output_index=index,
                              item=item.model_copy(update={"status": "in_progress", "arguments": ""}))

    def _delta(self, index: int, item, delta: str) -> str:
        if isinstance(item, OutputMessage):
            return self._event(TextDeltaEvent, item_id=item.id, output_index=index, content_index=0, delta=delta)
        return self._event(ArgumentsDeltaEvent, item_id=item.id, output_index=index, delta=delta)

    def _closed(self, index: int, item) -> Iterator[str]:
        """An item's closing events, with its whole content."""
        if isinstance(item, OutputMessage):
            (part,) = item.content
            yield self._event(TextDoneEvent, item_id=item.id, output_index=index, content_index=0, text=part.text)
            yield self._event(ContentPartEvent, type="response.content_part.done", item_id=item.id,
                              output_index=index, content_index=0, part=part)
        else:
            yield self._event(ArgumentsDoneEvent, item_id=item.id, output_index=index, arguments=item.arguments,
                              name=item.name)
        yield self._event(OutputItemEvent, type="response.output_item.done", output_index=index, item=item)

    async def events(self) -> AsyncIterator[str]:
        start = self.response("in_progress", [])
        yield self._lifecycle("response.created", start)
        yield self._lifecycle("response.in_progress", start)
        live = not self.req.uses_tools()       # without tools the message streams as it comes
        streaming = self.message("", "in_progress")
        texts: list[str] = []
        last = None
        async with self.choices:   # leaving early (client disconnect -> cancellation) aborts the request
            if live:
                for e in self._opened(0, streaming):
                    yield e
            async for _, out in self.choices:
                last = out
                if out.new_text:
                    texts.append(out.new_text)
                    if live:
                        yield self._delta(0, streaming, out.new_text)
        status, error = self.status(last)
        if error:
            yield self._lifecycle("response.failed", self.response(status, [], last, error))
            return
        items = self.output("".join(texts), status)
        for index, item in enumerate(items):
            if not live:
                for e in self._opened(index, item):
                    yield e
                content = item.content[0].text if isinstance(item, OutputMessage) else item.arguments
                if content:
                    yield self._delta(index, item, content)
            for e in self._closed(index, item):
                yield e
        yield self._lifecycle("response.incomplete" if status == "incomplete" else "response.completed",
                              self.response(status, items, last))
