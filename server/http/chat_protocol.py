"""Wire models of the chat completions API (/v1/chat/completions): messages (which the Responses
and tokenization APIs read as well), the request with its tools, and the answers (`ChatCompletion`,
and `ChatCompletionChunk` when streamed). Built on http/protocol.py's `SamplingRequest`; rendered
by http/chat.py.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, model_validator

from ..text.grammar import GrammarSpec
from .protocol import OpenModel, SamplingRequest, Usage, absent
from .tools import check_tools, constraint

class ToolCallFunction(OpenModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(OpenModel):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction | None = None


class ChatMessage(OpenModel):
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None      # an assistant turn that called tools (replayed history)
    tool_call_id: str | None = None               # a tool's answer to one of those calls
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError("only text content parts are supported ({'type': 'text', 'text': ...})")
                parts.append(p["text"])
            return "".join(parts)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: role and content text, plus a replayed tool
        conversation's fields (tool call arguments as objects, the Hugging Face convention)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                fn = c.function or ToolCallFunction()
                try:
                    args = json.loads(fn.arguments) if fn.arguments else {}
                except ValueError:
                    args = fn.arguments
                calls.append({"id": c.id, "type": c.type, "function": {"name": fn.name, "arguments": args}})
            out["tool_calls"] = calls
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True              # vLLM's chat-template extensions
    chat_template_kwargs: dict[str, Any] | None = None

    def uses_tools(self) -> bool:
        """Whether the answer may carry tool calls (tools given, tool_choice not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_by_tools(self) -> GrammarSpec | None:
        return constraint(self.tools, self.tool_choice, self.parallel_tool_calls) if self.uses_tools() else None

    @model_validator(mode="after")
    def _tools_and_modalities(self):
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            check_tools(self.tools or [], self.tool_choice)
        if self.modalities not in (None, ["text"]):
            raise ValueError(f"modalities {self.modalities}: hloserve answers text only")
        return self


# -- the answer ---------------------------------------------------------------------------------

class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str                  # JSON text


class CalledTool(BaseModel):
    """A tool call in an answer; `index` only in a streamed delta."""
    index: int | None = Field(default=None, exclude_if=absent)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[CalledTool] | None = Field(default=None, exclude_if=absent)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a streamed chunk adds to its choice's message (empty when it only ends the choice)."""
    role: Literal["assistant"] | None = Field(default=None, exclude_if=absent)
    content: str | None = Field(default=None, exclude_if=absent)
    tool_calls: list[CalledTool] | None = Field(default=None, exclude_if=absent)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
