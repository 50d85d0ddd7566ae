"""The completions API (POST /v1/completions) for LLM services: its route, preparation and renderer
(wire models: http/completions_protocol.py).

The route parses the body off the event loop and runs the generation path (http/generate.py:
admit, prepare, submit, render). Preparation: every prompt (text, or token ids) tokenized; `best_of` generates that many candidates
per prompt (with logprobs, to rank them) and answers the `n` most likely. Rendering: `echo` puts
each prompt's text first (and, with logprobs, its tokens' logprobs, the first one None as
OpenAI's); choice i of the answer belongs to prompt i // n.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from fastapi import APIRouter, Request

from ..core.outputs import FinishReason, RequestOutput
from ..core.sampling import TokenLogprobs
from ..services import LLMService
from .chunks import ChunkStream, token_str, usage
from .completions_protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .errors import check_model
from .fanin import Choices, Finished
from .generate import generate
from .prepare import Generation, checked_text, openai_generation, parse_body

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions (chat's is the room left in the context)

router = APIRouter()
BODIES = {"/v1/completions": CompletionRequest}   # the body its route parses itself, for /openapi.json
ANSWERS = {"/v1/completions": Completion}          # its answer (not streamed), for /openapi.json


@router.post("/v1/completions")
async def completions(request: Request):
    req = await parse_body(request, CompletionRequest)
    svc: LLMService = request.app.state.service
    check_model(svc, req.model)
    return await generate(svc, request, req, prepare=lambda: prepare(svc, req), stream=req.stream,
                          renderer=lambda gen, choices: CompletionRenderer(svc, req, gen, choices))


def prepare(svc: LLMService, req: CompletionRequest) -> Generation:
    prompts = [svc.tokenizer.encode(checked_text(svc, p, "prompt")) if isinstance(p, str) else [int(t) for t in p]
               for p in req.prompts()]
    best_of = req.candidates() > req.n
    return openai_generation(
        svc, req, prompts, max_tokens=req.max_tokens, logprobs=0 if best_of and req.logprobs is None else req.logprobs,
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None, samples=req.candidates(),
        default=DEFAULT_MAX_TOKENS, prompt_param="prompt")


class CompletionRenderer(ChunkStream):
    """A completions request's answer (`Completion`), whole or as chunks."""

    def __init__(self, svc: LLMService, req: CompletionRequest, gen: Generation, choices: Choices):
        super().__init__(svc, req, choices, choices.request_id)
        # per prompt, its text as sent (decoded when it was token ids or truncated)
        self.echo = [p if isinstance(p, str) and req.truncate_prompt_tokens is None else svc.tokenizer.decode(ids)
                     for p, ids in zip(req.prompts(), gen.prompts)] if req.echo else None
        self.prompt_ids = gen.prompts
        self._prompt_logprobs: dict[int, tuple] = {}   # streaming: per prompt, once its first output came
        self._echoed: set[int] = set()

    # -- whole ----------------------------------------------------------------------------------
    def answer(self, results: list[Finished]) -> Completion:
        req = self.req
        total = usage(self.choices.prompt_tokens, [r.last for r in results])   # every candidate counts
        if req.candidates() > req.n:
            results = best(results, req.candidates(), req.n, keep_logprobs=req.logprobs is not None)
        out = []
        for i, r in enumerate(results):
            p = i // req.n
            text = self.echo[p] + r.text if self.echo else r.text
            out.append(CompletionChoice(index=i, text=text, finish_reason=r.finish_reason,
                                        logprobs=self.logprobs(r.logprobs, p, r.prompt_logprobs)
                                        if req.logprobs is not None else None))
        return Completion(id=self.request_id, created=self.created, model=req.model, choices=out, usage=total)

    # -- streamed -------------------------------------------------------------------------------
    def body(self, choices: list, usage) -> Completion:
        return Completion(id=self.request_id, created=self.created, model=self.req.model, choices=choices,
                          usage=usage)

    def opening(self) -> Iterator[CompletionChoice]:
        if self.echo and self.req.logprobs is None:
            for i in range(len(self.choices)):
                yield CompletionChoice(index=i, text=self.echo[self.choices.prompt_of(i)], logprobs=None,
                                       finish_reason=None)

    def before(self, i: int, out: RequestOutput) -> Iterator[CompletionChoice]:
        """With echo and logprobs, each choice's prompt chunk waits for its prompt's logprobs."""
        p = self.choices.prompt_of(i)
        if out.prompt_logprobs is not None:
            self._prompt_logprobs[p] = out.prompt_logprobs
        if self.echo and self.req.logprobs is not None and i not in self._echoed:
            self._echoed.add(i)
            yield CompletionChoice(index=i, text=self.echo[p], finish_reason=None,
                                   logprobs=self.logprobs([], p, self._prompt_logprobs.get(p)))

    def chunk(self, i: int, out: RequestOutput, logprobs: list, reason: FinishReason | None) -> CompletionChoice:
        return CompletionChoice(index=i, text=out.new_text, finish_reason=reason,
                                logprobs=self.logprobs(logprobs) if self.req.logprobs is not None and logprobs
                                else None)

    # -- logprobs -------------------------------------------------------------------------------
    def logprobs(self, lps: list[TokenLogprobs], prompt: int | None = None,
                 prompt_logprobs: tuple | None = None) -> CompletionLogprobs:
        """OpenAI's completions logprobs; with echo (and the prompt's logprobs known) the prompt's
        tokens come first, the first one without a logprob."""
        entries = [(lp.token_id, lp) for lp in lps]                      # (token id, its logprobs or None)
        if self.echo and prompt_logprobs is not None:
            entries = [(self.prompt_ids[prompt][0], None)] + [(lp.token_id, lp) for lp in prompt_logprobs] + entries
        tokens = [token_str(self.svc, t) for t, _ in entries]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[None if lp is None else lp.logprob for _, lp in entries],
            top_logprobs=[None if lp is None else {token_str(self.svc, t): v for t, v in lp.top} for _, lp in entries],
            text_offset=offsets)


def best(results: list[Finished], m: int, n: int, *, keep_logprobs: bool) -> list[Finished]:
    """best_of: of each prompt's m candidates, the n with the highest log-probability (the sum over
    their tokens), most likely first."""
    out = []
    for p in range(0, len(results), m):
        group = sorted(results[p:p + m], key=lambda r: -sum(lp.logprob for lp in r.logprobs))[:n]
        out += [r if keep_logprobs else dataclasses.replace(r, logprobs=[]) for r in group]
    return out
