"""The streamed answer shared by completions and chat: OpenAI's chunk stream over the fan-in.

    opening chunks (per choice) -> per output: a chunk when it carries text, logprobs or the end
    (an engine error sends OpenAI's error object and ends the stream) -> the usage chunk
    (stream_options.include_usage) -> `data: [DONE]`

Each chunk names its choice index; the renderer (http/completions.py, http/chat.py) says what a
chunk holds. Token text for logprobs is decoded here, once per token.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator

from pydantic import BaseModel

from ..core.outputs import FinishReason, RequestOutput
from ..core.sampling import TokenLogprobs
from ..services import LLMService
from .fanin import Choices
from .generate import sse
from .protocol import SamplingRequest, Usage, error_body, now


def token_str(svc: LLMService, token_id: int) -> str:
    """A token's text as logprobs show it (special tokens included)."""
    return svc.tokenizer.decode([token_id], skip_special_tokens=False)


def usage(prompt_tokens: int, lasts) -> Usage:
    """Each prompt counted once (its n choices share it), the completions summed."""
    return Usage.of(prompt_tokens, sum(o.num_output_tokens for o in lasts if o is not None))


class ChunkStream:
    """A renderer's streaming half for completions and chat; subclasses say what each chunk holds."""

    def __init__(self, svc: LLMService, req: SamplingRequest, choices: Choices, request_id: str):
        self.svc, self.req, self.choices = svc, req, choices
        self.request_id = request_id
        self.created = now()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def body(self, choices: list, usage: Usage | None) -> BaseModel:
        """A chunk holding `choices` (and the usage, when asked for)."""
        raise NotImplementedError

    def opening(self) -> Iterator[BaseModel]:
        """The choices' first chunk(s), before any output."""
        return iter(())

    def before(self, i: int, out: RequestOutput) -> Iterator[BaseModel]:
        """Chunk choices sent before choice i's output `out` is looked at."""
        return iter(())

    def chunk(self, i: int, out: RequestOutput, logprobs: list[TokenLogprobs], reason: FinishReason | None):
        """The chunk choice for one output (None: nothing to send)."""
        raise NotImplementedError

    def _sse(self, choice: BaseModel | None, usage: Usage | None = None) -> str:
        return sse(self.body([choice] if choice is not None else [], usage),
                   exclude=None if self.include_usage else {"usage"})

    async def events(self) -> AsyncIterator[str]:
        lasts: list = [None] * len(self.choices)
        async with self.choices:   # leaving early (client disconnect -> cancellation) aborts the requests
            for c in self.opening():
                yield self._sse(c)
            async for i, out in self.choices:
                lasts[i] = out
                for c in self.before(i, out):
                    yield self._sse(c)
                if out.finish_reason is FinishReason.ERROR:
                    yield sse(error_body(f"generation failed: {out.error}", type_="internal_error"))
                    break
                lps = list(out.logprobs or ())
                reason = out.finish_reason if out.finished else None
                if not out.new_text and not reason and not lps:
                    continue
                c = self.chunk(i, out, lps, reason)
                if c is not None:
                    yield self._sse(c)
            if self.include_usage:
                yield self._sse(None, usage(self.choices.prompt_tokens, lasts))
            yield "data: [DONE]\n\n"
