"""Request bodies read within budgets, without stalling the event loop.

A body is read under three budgets (`BodyLimits`, from ServeConfig's max_body_bytes,
max_body_chunks and body_timeout_s): its bytes, its chunks (Transfer-Encoding: chunked) and a
deadline counted from the moment its headers arrived. A body past one is refused with 413, 400 or
408, raised as an ApiError in the route reading it, so app.py's handlers answer in the route's own
API format (OpenAI's error object, or TF Serving's {"error": ...}); the answer says
`Connection: close` and the rest of the body is never parsed.

Two layers share the work, because neither sees all of it:

* `BoundedH11Protocol` (uvicorn's h11 protocol; serve.py hands it to uvicorn.Config as `http=`)
  sees the wire. It parses what a socket read brings in slices of SLICE bytes, one slice per
  event-loop turn with reading paused in between, so a body of millions of one-byte chunks (6 wire
  bytes and ~15 us of h11 parsing each) never holds the loop for more than a slice; and it counts
  the chunks of the body being read, which the application never sees (uvicorn hands it the bytes
  of many chunks as one message). Past `max_chunks` it parses nothing more of the connection,
  discards what still arrives, and notes the refusal for the request's reader.
* `BodyReader` (wrapped around the ASGI receive and send by app.py's middleware) counts the bytes,
  keeps the deadline, raises the refusal the protocol noted, and marks an answer sent before the
  body ended `Connection: close`.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from .errors import ApiError

SLICE = 16384            # wire bytes parsed per event-loop turn: ~2,700 one-byte chunks, ~40 ms at most
REFUSED = "hloserve.body_refused"   # the scope's extensions key under which the protocol notes a refusal
_CLOSE = (b"connection", b"close")


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    """What one request body may take: bytes, chunks, and seconds from its headers to its end."""
    max_bytes: int = 16 << 20
    max_chunks: int = 16384
    timeout_s: float = 60.0


class _CountingConnection(h11.Connection):
    """h11's server side, counting the chunks of the request body being read; past `limit` it
    parses nothing more and calls `on_excess` once."""

    def __init__(self, limit: int, on_excess: Callable[[], None], max_incomplete_event_size: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.limit, self.on_excess, self.chunks = limit, on_excess, 0

    def next_event(self):
        if self.chunks > self.limit:
            return h11.NEED_DATA
        event = super().next_event()
        if isinstance(event, h11.Request):
            self.chunks = 0
        elif isinstance(event, h11.Data) and event.chunk_start:
            self.chunks += 1
            if self.chunks > self.limit:
                self.on_excess()
                return h11.NEED_DATA
        return event


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, parsing one SLICE per loop turn and counting body chunks (see above).
    Made by uvicorn per connection: `functools.partial(BoundedH11Protocol, max_chunks=N)`."""

    def __init__(self, *args, max_chunks: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _CountingConnection(max_chunks, self._refuse, self.config.h11_max_incomplete_event_size
                                        or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.max_chunks = max_chunks
        self._backlog = bytearray()     # read, not parsed yet
        self._scheduled = False         # a _feed is scheduled for the next loop turn
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:               # discarded: nothing more is parsed, the answer closes the connection
            return
        self._backlog += data
        if not self._scheduled:
            self._feed()

    def _feed(self) -> None:
        """Parse one slice of the backlog; the rest on the next loop turn, reading paused till then."""
        self._scheduled = False
        if self.transport.is_closing() or self._refused:
            self._backlog.clear()
            return
        piece = bytes(self._backlog[:SLICE])
        del self._backlog[:SLICE]
        super().data_received(piece)
        if self._refused or self.transport.is_closing():
            return
        if self._backlog:
            self.transport.pause_reading()
            self._scheduled = True
            self.loop.call_soon(self._feed)
        elif not self.flow.read_paused:   # unless uvicorn's own flow control holds it
            self.transport.resume_reading()

    def _refuse(self) -> None:
        """Past max_chunks: the request's reader raises 400 on its next receive (with no reader left
        to answer, the connection closes now)."""
        self._refused = True
        self._backlog.clear()
        self.transport.resume_reading()   # what still comes is read and dropped
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        cycle.scope.setdefault("extensions", {})[REFUSED] = (
            f"the request body came in more than {self.max_chunks} chunks; send it in fewer, larger chunks "
            f"(the server's limit is --max-body-chunks)")
        cycle.message_event.set()


class BodyReader:
    """One request's receive and send under `limits` (see the module docstring)."""

    def __init__(self, scope, receive, send, limits: BodyLimits):
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"")
        self.scope, self._receive, self._send, self.limits = scope, receive, send, limits
        # nothing to read: a request without a body (its receive only ever reports the disconnect)
        self.done = b"transfer-encoding" not in headers and (not length.isdigit() or int(length) == 0)
        self.seen = 0
        self.deadline = asyncio.get_running_loop().time() + limits.timeout_s

    async def receive(self):
        if self.done:
            return await self._receive()
        left = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(left, 0.0))
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.timeout_s:g} s; send it "
                                f"at once (the server's limit is --body-timeout)") from None
        refused = self.scope.get("extensions", {}).get(REFUSED)
        if refused:
            raise ApiError(400, refused)
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limits.max_bytes:
                raise ApiError(413, too_large(self.limits.max_bytes))
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        return message

    async def send(self, message):
        if message["type"] == "http.response.start" and not self.done:
            # answered before the body ended: the rest of it is not read, so the connection cannot carry
            # another request; closing it also stops uvicorn parsing what is still coming
            message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        await self._send(message)


def too_large(max_bytes: int) -> str:
    return (f"request body is larger than {max_bytes} bytes; send a shorter prompt "
            f"(the server's limit is --max-body-mib)")
