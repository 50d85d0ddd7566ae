"""Wire models shared by the OpenAI-compatible APIs (pydantic): OpenAI's error format, the open
request base, and the sampling fields completions and chat completions share.

Every field of OpenAI's completions and chat-completions requests is accepted, and so are vLLM's
sampling extensions. Fields that change results are implemented (sampling, penalties, logit_bias,
min_p, min_tokens, n, best_of, echo, several prompts, structured output, tool calls, ...); a field
that hloserve cannot honour answers 400 saying so (`neutral_only`), and every other field is
accepted at any value that does not change the result (OpenAI's bookkeeping fields: store,
metadata, user, service_tier, ...). A field nobody knows is ignored, as vLLM does, and named in the
response's `x-hloserve-warning` header and the log, so a typo is visible but a newer client still works.

Each API's own models are in its `<api>_protocol.py` (http/completions_protocol.py,
chat_protocol.py, responses_protocol.py, tokenization_protocol.py, embeddings_protocol.py); an
optional answer field marked `exclude_if=absent` is left out of the JSON when it is None, as
OpenAI leaves it out.
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..text.grammar import GrammarSpec


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


def now() -> int:
    """Unix seconds (an answer's `created`)."""
    return int(time.time())


def absent(value) -> bool:
    """`exclude_if` for an optional answer field OpenAI leaves out of the JSON when it is None."""
    return value is None


class Usage(BaseModel):
    """Token counts: each prompt counted once (its n choices share it), the completions summed."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
