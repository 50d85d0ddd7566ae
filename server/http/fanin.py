"""Fan-in: the engine's request streams of one API request (its choices), read as one.

A renderer reads `Choices` either as they come (`async for i, out in choices`, streaming) or
whole (`await choices.collect(request)`, one `Finished` per choice). Leaving it (`async with`) or
`abort()` aborts every request still running, so a client that leaves frees its KV blocks before
the next step.
"""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request

from ..core.outputs import FinishReason, RequestOutput
from ..core.sampling import TokenLogprobs
from .errors import SHUTTING_DOWN, ApiError


@dataclasses.dataclass
class Finished:
    """One choice's whole answer.

    Attributes:
      text: the generated text.
      logprobs: one entry per generated token, when the request asked for logprobs.
      last: its last output (None: it never produced one, it was aborted first).
      prompt_logprobs: its prompt's, when the request asked for them (echo).
    """
    text: str
    logprobs: list[TokenLogprobs]
    last: RequestOutput | None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def finish_reason(self) -> str:
        return self.last.finish_reason if self.last is not None else FinishReason.ABORT

    @property
    def output_tokens(self) -> int:
        return self.last.num_output_tokens if self.last is not None else 0


def failure(out: RequestOutput | None) -> ApiError | None:
    """The error answer for a choice that failed (503 when the server shut down under it), else None."""
    if out is None or out.finish_reason is not FinishReason.ERROR:
        return None
    if out.error == SHUTTING_DOWN:
        return ApiError(503, SHUTTING_DOWN, type_="service_unavailable", headers={"Retry-After": "1"})
    return ApiError(500, f"generation failed: {out.error}", type_="internal_error")


class Choices:
    """The request streams of one API request: choice p * samples + i is prompt p's sample i."""

    def __init__(self, request_id: str, streams: list, *, prompt_tokens: int, samples: int = 1):
        self.request_id = request_id
        self.streams = streams
        self.prompt_tokens = prompt_tokens     # all prompts of the request, each counted once
        self.samples = samples

    def __len__(self) -> int:
        return len(self.streams)

    def prompt_of(self, choice: int) -> int:
        return choice // self.samples

    def abort(self) -> None:
        for st in self.streams:
            st.abort()

    async def __aenter__(self) -> "Choices":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    async def __aiter__(self):
        """(choice index, output) as the engine produces them, until every choice has ended."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, st):
            try:
                async for out in st:
                    await queue.put((i, out))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(self.streams)]
        try:
            open_ = len(tasks)
            while open_:
                i, out = await queue.get()
                if out is None:
                    open_ -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, request: Request) -> list[Finished]:
        """Every choice's whole answer; a client disconnect aborts them. Raises the error answer
        (http/errors.py) of the first choice that failed."""
        async def watch():
            while True:
                await asyncio.sleep(0.25)
                if await request.is_disconnected():
                    self.abort()
                    return

        watcher = asyncio.create_task(watch())
        texts: list[list[str]] = [[] for _ in self.streams]
        done = [Finished("", [], None) for _ in self.streams]
        try:
            async with self:
                async for i, out in self:
                    texts[i].append(out.new_text)
                    done[i].logprobs.extend(out.logprobs or ())
                    done[i].last = out
                    if out.prompt_logprobs is not None:
                        done[i].prompt_logprobs = out.prompt_logprobs
        finally:
            watcher.cancel()
        for f, t in zip(done, texts):
            f.text = "".join(t)
            error = failure(f.last)
            if error is not None:
                raise error
        return done
