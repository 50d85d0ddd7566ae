"""Request preparation for the generation routes: body, text checks, output budget, SamplingParams, submission.

Every API (completions, chat, responses) turns its request into a `Generation` (prompt token ids
and one SamplingParams per prompt) with the helpers here, on a worker thread; `submit` hands it to
the engine and returns the fan-in (http/fanin.py) that a renderer reads. The context rule (prompt
plus output fit the model's context) is the scheduler's (`core.scheduler.check_context`), applied
here first so a request that cannot fit answers 400 naming the field before it reaches the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import uuid
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ..config import MAX_PROMPT_CHARS_PER_TOKEN
from ..core.sampling import SamplingParams
from ..core.request import check_context, context_room
from ..services import LLMService
from .errors import ApiError
from .fanin import Choices
from .protocol import OpenModel, SamplingRequest

log = logging.getLogger("hloserve.server")
MAX_MESSAGES = 8192   # a chat's messages (or a response's input items), counted from the raw body before parsing
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")   # field names written as they are; any other is JSON-quoted


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    """An API request as the engine takes it.

    Attributes:
      prompts: token ids per prompt.
      params: one SamplingParams per prompt (its output budget depends on the prompt's length).
      samples: requests per prompt (n, or best_of's candidates); sample i's seed is the seed plus i,
        and the samples of one prompt share its cached blocks. Choice p * samples + i is prompt p's
        sample i.
    """
    prompts: list[list[int]]
    params: list[SamplingParams]
    samples: int = 1


async def parse_body(request: Request, model: type[BaseModel], *, counted: bytes | None = None) -> BaseModel:
    """The request body validated as `model` on a worker thread: a large JSON body (16 MiB at most)
    takes a while to parse, and the event loop keeps serving /health and every stream meanwhile.
    `counted` (e.g. b'"role"') bounds the messages of a body before it is validated."""
    body = await request.body()
    if counted is not None and body.count(counted) > MAX_MESSAGES:
        # validating is pure CPU under the GIL (~2.5 us a message): bounded before it starts
        raise ApiError(400, f"more than {MAX_MESSAGES} messages in one request",
                       param="messages" if counted == b'"role"' else "input")
    try:
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def checked_text(svc: LLMService, text: str, param: str) -> str:
    """Refuse text that could never fit the context, and text that is not UTF-8, before tokenizing it."""
    limit = svc.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    if len(text) > limit:
        raise ApiError(400, f"the {param} has {len(text)} characters; a context of {svc.max_model_len} tokens holds "
                            f"far fewer (limit {limit}); shorten it", param=param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the {param} is not valid Unicode text ({e.reason} at character {e.start}); "
                            f"send UTF-8 text", param=param) from None
    return text


def encode_chat(svc: LLMService, messages: list[dict], *, add_generation_prompt: bool = True,
                variables: dict | None = None, param: str = "messages") -> list[int]:
    """A conversation's prompt ids through the model's chat template (400 when it cannot be applied)."""
    try:
        checked_text(svc, "".join(m["content"] for m in messages), param)
        return svc.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, variables=variables)
    except ValueError as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param=param) from None


def warn_ignored(req: OpenModel) -> dict[str, str]:
    """Response headers naming the request fields hloserve does not know (ignored, as vLLM does).

    A field name is client bytes: it goes into the header escaped to printable ASCII (JSON's escapes,
    quoted unless it is a plain name), so no name (empty, spaces, non-Latin-1, CR/LF) can break the
    header's encoding or inject a line."""
    ignored = req.ignored_fields()
    if not ignored:
        return {}
    names = ", ".join(n if _PLAIN_NAME.fullmatch(n) else json.dumps(n) for n in ignored)
    log.warning("request fields ignored (unknown to hloserve): %s", names)
    # cut to a bounded length; a header value may not end in whitespace (h11 refuses to send it)
    return {"x-hloserve-warning": f"ignored unknown fields: {names}"[:1000].rstrip()}


def output_budget(svc: LLMService, prompt_len: int, asked: int | None, *, default: int | None, prompt_param: str,
                  name: str = "max_tokens") -> int:
    """The most tokens a prompt's answer may have: `asked` (the request's `name` field), or when the
    request is silent the smaller of the route's `default` (None: all the room the context leaves)
    and the generation defaults' max_tokens (as vLLM's), never past the operator's cap
    (--max-output-tokens) or the context rule."""
    try:
        room = context_room(prompt_len, svc.max_model_len)
    except ValueError as e:
        raise ApiError(400, str(e), param=prompt_param) from None
    cap = svc.max_output_tokens
    if asked is None:
        return min(room, default or room, svc.generation_defaults.get("max_tokens") or room, cap or room)
    if cap is not None and asked > cap:
        raise ApiError(400, f"{name}={asked} exceeds this server's limit of {cap} tokens per request; "
                            f"lower {name}", param=name)
    try:
        check_context(prompt_len, asked, svc.max_model_len, name=name)
    except ValueError as e:
        raise ApiError(400, str(e), param=name) from None
    return asked


# the request fields whose omission takes the server's generation defaults (SamplingParams' names)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(svc: LLMService, **fields: Any) -> SamplingParams:
    """SamplingParams from a request's fields, with the server's generation defaults
    (svc.generation_defaults) where a DEFAULTED field is None, and SamplingParams' neutral ones where
    neither says (400 for values SamplingParams refuses). A request's explicit value always wins:
    `temperature: 0` is greedy whatever the defaults."""
    for name in DEFAULTED:
        if fields.get(name) is None:
            fields[name] = svc.generation_defaults.get(name)
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None or k not in DEFAULTED})
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def matchers(svc: LLMService, gen: Generation) -> list:
    """Each choice's grammar matcher (None where it asks for no structured output), made on the
    request's worker thread: a grammar compiles in milliseconds to seconds. ValueError (a 400) for a
    grammar that does not compile."""
    return [svc.engine.structured.matcher(params) for params in gen.params for _ in range(gen.samples)]


def submit(svc: LLMService, gen: Generation, made: list) -> Choices:
    """Enqueue every sample of every prompt with its matcher (`matchers`); the fan-in over their
    streams. On a refusal (ValueError, a 400) the samples already enqueued are aborted."""
    rid = f"cmpl-{uuid.uuid4().hex}"
    total = len(gen.prompts) * gen.samples
    streams: list = []
    try:
        for p, (ids, params) in enumerate(zip(gen.prompts, gen.params, strict=True)):
            for i in range(gen.samples):
                seed = None if params.seed is None else params.seed + i
                k = p * gen.samples + i
                streams.append(svc.engine.add_request(ids, dataclasses.replace(params, seed=seed),
                                                      request_id=rid if total == 1 else f"{rid}-{k}",
                                                      matcher=made[k]))
    except BaseException:
        for st in streams:
            st.abort()
        raise
    return Choices(rid, streams, prompt_tokens=sum(len(ids) for ids in gen.prompts), samples=gen.samples)


def openai_generation(svc: LLMService, req: SamplingRequest, prompts: list[list[int]], *, max_tokens: int | None,
                      logprobs: int | None, prompt_logprobs: int | None = None, samples: int = 1,
                      default: int | None, prompt_param: str) -> Generation:
    """A completions or chat request's Generation: its prompts (cut to truncate_prompt_tokens) with
    their SamplingParams from the request's fields."""
    if req.truncate_prompt_tokens is not None:
        prompts = [ids[-req.truncate_prompt_tokens:] for ids in prompts]
    params = []
    for ids in prompts:
        budget = output_budget(svc, len(ids), max_tokens, default=default, prompt_param=prompt_param)
        params.append(sampling_params(
            svc, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            repetition_penalty=req.repetition_penalty, max_tokens=budget, stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()), seed=req.seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, ignore_eos=req.ignore_eos, min_p=req.min_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=req.bias_pairs(), min_tokens=min(req.min_tokens, budget), structured=req.structured(),
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            adapter=svc.adapter_ref(req.model)))
    return Generation(prompts=prompts, params=params, samples=samples)
