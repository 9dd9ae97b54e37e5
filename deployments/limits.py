"""The ingress's per-request limits that are not about tokens (those are ``ContextLimits``):
the body's size and the requests each API key has in flight.

The body is read at most ``limits.max_body_bytes`` far: a ``Content-Length`` over it is
refused unread, and a body without one (chunked) is counted as it arrives and refused as
soon as it passes the limit. (Serve's HTTP proxy relays what the client sends until the
answer goes out; a hard cap on the wire belongs to a proxy in front.)

A key's slot is held for the request's whole life: for a streamed answer until the stream
has been sent or the client went away (``HeldStreamingResponse`` gives it back in a
``finally`` around sending, which also covers a stream that never started).
"""

from __future__ import annotations

from collections import Counter

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the request body is over {max_bytes} bytes (limits.max_body_bytes)")
        self.max_bytes = max_bytes


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or ``BodyTooLarge`` once it is known to be over ``max_bytes`` (from its
    ``Content-Length``, else while reading it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise BodyTooLarge(max_bytes)
    return bytes(body)


class Slot:
    """One request's place in its key's count; ``release`` is idempotent."""

    def __init__(self, slots: KeySlots | None = None, key_id: int | None = None) -> None:
        self._slots, self._key_id = slots, key_id

    def release(self) -> None:
        if self._slots is not None:
            self._slots._counts[self._key_id] -= 1
            self._slots = None


class KeySlots:
    """Requests in flight per API key (keyed by the key's index, never the key), at most
    ``limit`` each; ``limit`` None, or a request without a key (auth off): not counted."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._counts: Counter[int] = Counter()

    def take(self, key_id: int | None) -> Slot | None:
        """A slot, or None when the key already has ``limit`` requests in flight."""
        if self.limit is None or key_id is None:
            return Slot()
        if self._counts[key_id] >= self.limit:
            return None
        self._counts[key_id] += 1
        return Slot(self, key_id)


class HeldStreamingResponse(StreamingResponse):
    """A streamed answer that releases its key's slot when sending ends, however it ends
    (also when the client left before the stream's first chunk, so its generator never started)."""

    def __init__(self, *args, slot: Slot, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, _disconnect_on_cancel(receive), send)
        finally:
            self.slot.release()


def _disconnect_on_cancel(receive: Receive) -> Receive:
    """Serve's ``receive`` raises Ray's ``TaskCancelledError`` once the client is gone (its
    request cancelled); Starlette's disconnect listener expects a message. Read that as the
    disconnect it is, so no task or future is left holding an unretrieved exception (they
    were logged with tracebacks)."""
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import RequestCancelledError

    async def receive_or_disconnect() -> Message:
        try:
            return await receive()
        except (TaskCancelledError, RequestCancelledError):
            return {"type": "http.disconnect"}

    return receive_or_disconnect
