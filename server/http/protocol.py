"""Wire models of the OpenAI-compatible API (pydantic), and OpenAI's error format.

Unknown fields are rejected (`extra="forbid"`): a typo such as `max_token`
answers 400 naming the field instead of being silently ignored. Fields OpenAI
defines but hloserve does not implement are accepted only at their neutral
value (e.g. presence_penalty=0), so a client that sends defaults still works.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)          # vLLM extension; -1 or None: off
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False                                  # vLLM extension (benchmarks)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral(cls, v: float, info) -> float:
        if v != 0.0:
            raise ValueError(f"{info.field_name} is not supported by hloserve; send 0 or omit it")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("hloserve takes one prompt per request (send several requests for a batch)")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt is empty")
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by hloserve")
        return v


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None

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


def now() -> int:
    return int(time.time())
