"""RequestStream: one request's outputs, handed from the engine's loop thread to its consumer."""
from __future__ import annotations

import asyncio
import queue
from typing import Callable, Iterator

from .outputs import RequestOutput


class RequestStream:
    """Outputs of one request, from the loop thread to the consumer.

    Created inside a running event loop it is async-iterable (`async for out in
    stream`); created outside one it is a plain iterator. Cancelling the task
    that awaits it (client disconnect) aborts the request; so do `abort()` and
    leaving an `async with stream:` block early. Iteration ends after the
    output with `finished=True`.
    """
    _DONE = object()

    def __init__(self, request_id: str, on_abort: Callable[[str], None]):
        self.request_id = request_id
        self._on_abort = on_abort
        self.finished = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._aq: asyncio.Queue | None = asyncio.Queue() if self._loop else None
        self._q: queue.Queue | None = None if self._loop else queue.Queue()

    # called on the loop thread
    def _put(self, out: RequestOutput) -> None:
        put_all([(self, out)])

    def abort(self) -> None:
        if not self.finished:
            self._on_abort(self.request_id)

    # `async with stream:` / `with stream:` abort the request if the body leaves before it finished
    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def __aiter__(self) -> "RequestStream":
        if self._aq is None:
            raise TypeError("this stream was created outside an event loop; iterate it with `for`, not `async for`")
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._aq.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        self.finished = out.finished
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._q is None:
            raise TypeError("this stream was created inside an event loop; iterate it with `async for`")
        return self

    def __next__(self) -> RequestOutput:
        if self.finished:
            raise StopIteration
        out = self._q.get()
        self.finished = out.finished
        return out

    def drain(self) -> list[RequestOutput]:
        """The outputs queued so far, without waiting (plain-iterator streams; for loops driven
        by hand with `Engine.run_once`)."""
        if self._q is None:
            raise TypeError("this stream was created inside an event loop; iterate it with `async for`")
        outs = []
        while not self.finished:
            try:
                out = self._q.get_nowait()
            except queue.Empty:
                break
            self.finished = out.finished
            outs.append(out)
        return outs


def put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Hand each output to its stream (called on the engine's loop thread), waking each consumer event
    loop once for all of its streams: one call_soon_threadsafe, so one write to that loop's wake-up
    pipe, per step instead of per stream (per token of each running request, that wake-up was ~15% of
    the engine thread's time at 16 requests). Each stream's outputs keep their order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
    for stream, out in items:
        if stream._loop is None:
            stream._q.put(out)
        else:
            by_loop.setdefault(stream._loop, []).append((stream, out))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, pairs)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens
            for stream, _ in pairs:
                stream._on_abort(stream.request_id)


def _deliver(pairs: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the consumer's event loop: each output into its stream's queue."""
    for stream, out in pairs:
        stream._aq.put_nowait(out)
