"""Wire models of OpenAI's Responses API (/v1/responses): the request, the Response, its stream events.

Input is a string or a list of items: messages (`role` and `content`, a string or parts of type
input_text / output_text), a function call the model made earlier (`function_call`) and its result
(`function_call_output`), so a tool conversation can be replayed whole. Tools are function tools;
`text.format` is text, json_object or json_schema. Fields that change the result but that hloserve
cannot honour (previous_response_id, background, conversation, prompt templates, truncation "auto",
other tool types, `include`) answer 400 naming the field; bookkeeping fields (store, metadata,
user, service_tier, prompt_cache_key, ...) are accepted and change nothing; unknown fields are
ignored and named in the `x-hloserve-warning` header, as on the other routes.

The answer models follow the openai SDK's types (openai/types/responses/): a `Response` with
output items (`message` with `output_text` parts, `function_call`), `usage`, and `status`
"completed" or "incomplete" (with `incomplete_details.reason` "max_output_tokens"); streamed as
`ResponseEvent`s, each with its `type` and a `sequence_number` counting from 0.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from ..text.grammar import GrammarSpec
from .chat_protocol import ChatMessage, ToolCall, ToolCallFunction
from .protocol import OpenModel, neutral_only
from .tools import constraint

# fields accepted only at a value that does not change the result: field -> (neutral?, the fix)
_NEUTRAL_ONLY = {
    "previous_response_id": (lambda v: v is None, "hloserve keeps no responses (it is stateless, so any replica "
                                                  "can answer): send the whole conversation as `input` instead"),
    "background": (lambda v: not v, "background responses are not supported; set background false"),
    "conversation": (lambda v: v is None, "conversations are not stored; send the whole conversation as `input`"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported; send the prompt as `input`"),
    "truncation": (lambda v: v in (None, "disabled"), "truncation 'auto' is not supported; shorten the input"),
    "include": (lambda v: not v, "`include` is not supported (no extra output data is available)"),
}


# -- input ------------------------------------------------------------------------------------------

class TextPart(OpenModel):
    """A text part of a message's content (input_text in a user/system turn, output_text when an
    earlier answer is replayed)."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None      # on a replayed output_text: accepted, unused
    logprobs: list[Any] | None = None


class MessageItem(OpenModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]
    id: str | None = None                     # on a replayed output item: accepted, unused
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenModel):
    """A call the model made (replayed from an earlier response's output)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenModel):
    """The result of a call, answered by the client."""
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


_ITEM_TYPES = ("message", "function_call", "function_call_output")
_PART_TYPES = ("input_text", "output_text")


def _item_type(v: Any) -> str:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]], Discriminator(_item_type)]


def _check_items(items: list) -> None:
    """ValueError naming the first input item (or content part) of a kind hloserve cannot read."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise ValueError(f"input[{i}] has type {kind!r}; hloserve reads {', '.join(_ITEM_TYPES)} items")
        if kind == "message" and ("role" not in item or "content" not in item):
            raise ValueError(f"input[{i}] is a message: it needs a role and content")
        parts = item.get("content") if kind == "message" else item.get("output")
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") not in _PART_TYPES:
                raise ValueError(f"input[{i}] content part {j} has type {part.get('type')!r}; hloserve reads text "
                                 f"parts ({', '.join(_PART_TYPES)}) only")


class FunctionTool(OpenModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None

    def as_chat(self) -> dict:
        """The tool in chat completions' form (what chat templates and http/tools.py read)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoiceFunction(OpenModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenModel):
    model_config = ConfigDict(extra="allow", serialize_by_alias=True)    # echoed in the answer as `schema`
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format json_schema needs `schema` (a JSON schema object)")
        return self


class TextConfig(OpenModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(OpenModel):
    include_obfuscation: bool | None = None


class ResponsesRequest(OpenModel):
    model: str
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    # bookkeeping: accepted, no effect on the result
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)   # logprobs only come with `include`
    # accepted only at a neutral value (see _NEUTRAL_ONLY)
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _readable_items(cls, v):
        if isinstance(v, list):
            _check_items(v)
        return v

    @field_validator("input")
    @classmethod
    def _some_input(cls, v):
        if not v:
            raise ValueError("input is empty; send a string or a list of input items")
        return v

    @field_validator(*_NEUTRAL_ONLY)
    @classmethod
    def _neutral_only(cls, v, info):
        return neutral_only(_NEUTRAL_ONLY, info.field_name, v)

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.name for t in self.tools or ()]
        if isinstance(self.tool_choice, ToolChoiceFunction) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.name!r}, which is not among the tools "
                             f"{names}")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    # -- as the chat path reads it --------------------------------------------------------------
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def chat_tools(self) -> list[dict]:
        return [t.as_chat() for t in self.tools or ()]

    def chat_tool_choice(self) -> Union[str, dict, None]:
        """tool_choice in chat completions' form."""
        if isinstance(self.tool_choice, ToolChoiceFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def structured(self) -> GrammarSpec | None:
        """The grammar on the output: a forced tool choice's, or text.format's (ValueError for both)."""
        found = []
        if self.uses_tools():
            forced = constraint(self.chat_tools(), self.chat_tool_choice(), self.parallel_tool_calls)
            if forced is not None:
                found.append(("tool_choice", forced))
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            found.append(("text.format", GrammarSpec("json")))
        elif fmt is not None and fmt.type == "json_schema":
            found.append(("text.format", GrammarSpec("json_schema", json.dumps(fmt.schema_))))
        if len(found) > 1:
            raise ValueError("tool_choice and text.format both constrain the output; send one")
        return found[0][1] if found else None

    def messages(self) -> list[dict]:
        """The conversation as chat templates read it: `instructions` as the system turn, then the
        input; consecutive function calls become one assistant turn with tool_calls, each output a
        tool turn."""
        turns: list[ChatMessage] = []
        if self.instructions is not None:
            turns.append(ChatMessage(role="system", content=self.instructions))
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                turns.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
                last = turns[-1] if turns else None
                if last is not None and last.role == "assistant" and last.tool_calls is not None:
                    last.tool_calls.append(call)
                elif last is not None and last.role == "assistant":
                    last.tool_calls = [call]
                else:
                    turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                turns.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        return [t.for_template() for t in turns]


# -- the answer -------------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[Union[OutputMessage, FunctionCall], Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int                 # prompt tokens whose KV blocks came from the prefix cache
    cache_write_tokens: int = 0        # (the SDK's field; hloserve does not count cache writes apart)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Union[str, ToolChoiceFunction] = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=lambda: TextConfig(format=TextFormat()))
    previous_response_id: None = None
    store: bool = False                # nothing is stored (see ResponsesRequest)
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


# -- stream events ----------------------------------------------------------------------------------

class ResponseLifecycleEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: Response


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class _TextEvent(BaseModel):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    logprobs: list[Any] = Field(default_factory=list)


class TextDeltaEvent(_TextEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str


class TextDoneEvent(_TextEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str


class ArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
    name: str
