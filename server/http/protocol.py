"""Wire models of the OpenAI-compatible API (pydantic), and OpenAI's error format.

Every field of OpenAI's completions and chat-completions requests is accepted, and so are vLLM's
sampling extensions. Fields that change results are implemented (sampling, penalties, logit_bias,
min_p, min_tokens, n, several prompts, ...); the few that hloserve cannot honour yet (best_of > n,
echo, suffix, structured output, tool calls) answer 400 saying so, and every other
field is accepted at any value that does not change the result (OpenAI's bookkeeping fields:
store, metadata, user, service_tier, ...). A field nobody knows is ignored, as vLLM does, and named
in the response's `x-hloserve-warning` header and the log, so a typo is visible but a newer client
still works.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


class ResponseFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"response_format {self.type!r} (structured output) is not supported by hloserve yet; "
                             f"send {{'type': 'text'}} or omit it")
        return self


class _Sampling(OpenModel):
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
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

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

    @field_validator("include_stop_str_in_output", "spaces_between_special_tokens")
    @classmethod
    def _default_only(cls, v, info):
        default = cls.model_fields[info.field_name].default
        if v != default:
            raise ValueError(f"{info.field_name}={v} is not supported by hloserve yet; omit it")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())


MAX_PROMPTS = 64   # prompts in one completions request (each answered by its own choice(s))

# completion fields accepted only at a value that does not change the result: field -> (neutral?, message)
_COMPLETION_NEUTRAL_ONLY = {
    "echo": (lambda v: not v, "echo is not supported by hloserve yet"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1 (choosing among extra completions) is not supported by "
                                          "hloserve yet; use n"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported by hloserve"),
}


class CompletionRequest(_Sampling):
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

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _neutral_only(cls, v, info):
        neutral, message = _COMPLETION_NEUTRAL_ONLY[info.field_name]
        if not neutral(v):
            raise ValueError(message)
        return v


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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True              # vLLM's chat-template extensions
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _no_tool_calls(self):
        if self.tools and self.tool_choice != "none":
            raise ValueError("tool calling is not supported by hloserve yet; omit tools (or send tool_choice 'none')")
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
