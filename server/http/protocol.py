"""Wire models of the OpenAI-compatible API (pydantic): requests, typed answers, and OpenAI's error format.

Every field of OpenAI's completions and chat-completions requests is accepted, and so are vLLM's
sampling extensions. Fields that change results are implemented (sampling, penalties, logit_bias,
min_p, min_tokens, n, best_of, echo, several prompts, structured output, tool calls, ...); the one
that hloserve cannot honour (suffix) answers 400 saying so, and every other field is accepted at
any value that does not change the result (OpenAI's bookkeeping fields: store, metadata, user,
service_tier, ...). A field nobody knows is ignored, as vLLM does, and named in the response's
`x-hloserve-warning` header and the log, so a typo is visible but a newer client still works.

The answers (`Completion`, `ChatCompletion`, `ChatCompletionChunk`) are what the renderers
(http/completions.py, http/chat.py) build; an optional field marked `exclude_if=_absent` is left
out of the JSON when it is None, as OpenAI leaves it out.
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..text.grammar import GrammarSpec
from .tools import check_tools, constraint


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class OpenModel(BaseModel):
    """Unknown fields are kept aside (`ignored_fields`) instead of failing the request."""
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self, prefix: str = "") -> list[str]:
        names = [prefix + k for k in (self.model_extra or {})]
        for name, value in self:
            items = value if isinstance(value, list) else [value]
            for i, v in enumerate(items):
                if isinstance(v, OpenModel):
                    names += v.ignored_fields(f"{prefix}{name}{f'[{i}]' if isinstance(value, list) else ''}.")
        return names


class StreamOptions(OpenModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format json_schema needs json_schema.schema (a JSON schema object)")
        return self


class StructuredOutputsParams(OpenModel):
    """vLLM's `structured_outputs` field: exactly one of these."""
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(OpenModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extensions)."""
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # OpenAI bookkeeping: accepted, no effect on the result
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM's sampling extensions
    top_k: int | None = Field(default=None, ge=-1)          # -1, 0 or None: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: spaces around special tokens when decoding. Only a slow (Python) tokenizer inserts
    # them; hloserve decodes with the tokenizer.json (fast) one, as vLLM's fast detokenizer does,
    # which ignores the flag: both values give the tokenizer's own text
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def forced_by_tools(self) -> GrammarSpec | None:
        """The grammar a forced tool choice puts on the output (chat overrides this)."""
        return None

    def structured(self) -> GrammarSpec | None:
        """The grammar the output must match, from whichever field gave one (ValueError for two)."""
        found: list[tuple[str, GrammarSpec]] = []
        forced = self.forced_by_tools()
        if forced is not None:
            found.append(("tool_choice", forced))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json")))
        elif rf is not None and rf.type == "json_schema":
            found.append(("response_format", GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_))))
        so = self.structured_outputs
        forms = [("guided_json", self.guided_json, "json_schema"), ("guided_regex", self.guided_regex, "regex"),
                 ("guided_choice", self.guided_choice, "choice"), ("guided_grammar", self.guided_grammar, "grammar")]
        if so is not None:
            forms += [("structured_outputs.json", so.json_, "json_schema"), ("structured_outputs.regex", so.regex, "regex"),
                      ("structured_outputs.choice", so.choice, "choice"),
                      ("structured_outputs.grammar", so.grammar, "grammar")]
            if so.json_object:
                found.append(("structured_outputs.json_object", GrammarSpec("json")))
        for name, value, kind in forms:
            if value is None:
                continue
            if kind == "json_schema" or kind == "choice":
                value = value if isinstance(value, str) else json.dumps(value)
            found.append((name, GrammarSpec(kind, value)))
        if len(found) > 1:
            raise ValueError(f"{' and '.join(n for n, _ in found)} both constrain the output; send one")
        return found[0][1] if found else None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _few(cls, v):
        if v > 16:
            raise ValueError("n must be at most 16")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k, b in (v or {}).items():
            if not k.lstrip("-").isdigit() or int(k) < 0:
                raise ValueError(f"logit_bias key {k!r} is not a token id")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias[{k}] = {b}: must be in [-100, 100]")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())


def neutral_only(table: dict, name: str, value):
    """`value` if it is neutral for field `name` (table: field -> (neutral?, the message)), else ValueError."""
    neutral, message = table[name]
    if not neutral(value):
        raise ValueError(message)
    return value


MAX_PROMPTS = 64   # prompts in one completions request (each answered by its own choice(s))

# completion fields accepted only at a value that does not change the result: field -> (neutral?, message)
_COMPLETION_NEUTRAL_ONLY = {
    "suffix": (lambda v: not v, "suffix (insertion) is not supported by hloserve"),
}


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_given(cls, v):
        prompts = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        if any(not p for p in prompts):
            raise ValueError("prompt is empty")
        return v

    def prompts(self) -> list:
        """The request's prompts (one, or several in a batch), each text or token ids."""
        v = self.prompt
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]

    def candidates(self) -> int:
        """Completions generated per prompt: best_of when it asks for more than n."""
        return max(self.n, self.best_of or 1)

    @model_validator(mode="after")
    def _echo_and_best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > 16:
            raise ValueError("best_of must be at most 16")
        if self.best_of and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best are known only at the end); set stream false")
        return self

    @field_validator("suffix")
    @classmethod
    def _neutral_only(cls, v, info):
        return neutral_only(_COMPLETION_NEUTRAL_ONLY, info.field_name, v)


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


class TokenizeRequest(OpenModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenModel):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(OpenModel):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _some(cls, v):
        if not v or (isinstance(v, list) and any(not x for x in v if isinstance(x, (str, list)))):
            raise ValueError("input is empty; send a string, a list of strings, or token ids")
        if isinstance(v, list) and len(v) > 2048:
            raise ValueError("at most 2048 inputs per request")
        return v


def now() -> int:
    return int(time.time())


# -- answers ------------------------------------------------------------------------------------

def _absent(value) -> bool:
    return value is None


class Usage(BaseModel):
    """Token counts: each prompt counted once (its n choices share it), the completions summed."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionLogprobs(BaseModel):
    """OpenAI's completions logprobs: per token its text, logprob (None for an echoed first prompt
    token), top alternatives and character offset in the choice's text."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class Completion(BaseModel):
    """A completions answer, and each chunk of a streamed one (OpenAI names both text_completion)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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
    index: int | None = Field(default=None, exclude_if=_absent)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[CalledTool] | None = Field(default=None, exclude_if=_absent)


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
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent)
    content: str | None = Field(default=None, exclude_if=_absent)
    tool_calls: list[CalledTool] | None = Field(default=None, exclude_if=_absent)


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
