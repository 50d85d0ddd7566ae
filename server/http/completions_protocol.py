"""Wire models of the completions API (/v1/completions): the request and its answer (`Completion`,
which is also each chunk of a streamed answer). Built on http/protocol.py's `SamplingRequest`;
rendered by http/completions.py.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from .protocol import SamplingRequest, Usage, neutral_only

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


# -- the answer ---------------------------------------------------------------------------------

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
