"""Wait for a condition with a deadline instead of sleeping for a guessed time.

A fixed sleep is either too short on a loaded CI machine (the test flakes) or longer than
needed everywhere else (CI time grows). These poll, first every ``POLL_S``, and return as soon
as the condition holds; past the deadline they fail with what was awaited and the last value
read, so a failure says what state the system was stuck in. The pause between polls grows
by ``BACKOFF`` up to ``MAX_POLL_S``: a long wait (a replica restarting) then reads its
condition (often an HTTP call that every replica answers) a few times a second, not fifty,
and leaves the 2 cores to what it waits for. Waits are on states that last once reached.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.02
MAX_POLL_S = 0.5
BACKOFF = 1.5


def _pauses(poll_s: float) -> Iterator[float]:
    """``poll_s``, then longer by ``BACKOFF`` each time, up to ``MAX_POLL_S`` (or ``poll_s`` if longer)."""
    pause, longest = poll_s, max(poll_s, MAX_POLL_S)
    while True:
        yield pause
        pause = min(pause * BACKOFF, longest)


def _timed_out(what: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; last value: {last!r}")


def wait_until(
    read: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    until: Callable[[T], bool] = bool,
    poll_s: float = POLL_S,
) -> T:
    """Call ``read`` until ``until(value)`` holds (by default: the value is truthy); return that value.

    ``read`` is called at least once, even with ``timeout_s=0``. Raises ``AssertionError``
    naming ``what`` and the last value once ``timeout_s`` has passed.
    """
    deadline, pauses = time.monotonic() + timeout_s, _pauses(poll_s)
    while True:
        value = read()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, value)
        time.sleep(min(next(pauses), max(0.0, deadline - time.monotonic())))


async def wait_until_async(
    read: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    *,
    until: Callable[[T], bool] = bool,
    poll_s: float = POLL_S,
) -> T:
    """``wait_until`` for code on an event loop: ``read`` may be a plain or an async function,
    and the poll yields to the loop (``asyncio.sleep``) instead of blocking it."""
    deadline, pauses = time.monotonic() + timeout_s, _pauses(poll_s)
    while True:
        value = read()
        if inspect.isawaitable(value):
            value = await value
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, value)
        await asyncio.sleep(min(next(pauses), max(0.0, deadline - time.monotonic())))


def ok_json(response) -> Any | None:
    """An HTTP answer's JSON if it is a 200, else None: an admin endpoint answers 503 while what
    it reports on is slow or restarting, which a wait reads as not yet (the last value it names
    on a timeout is then None, and the answer's text is in the test's log)."""
    return response.json() if response.status_code == 200 else None


class CallRecorder:
    """A callback that records its arguments (e.g. the request ids a transport releases) and
    when it was called (``time.time()``), and sets ``event`` on each call, so a test can wait
    for the first one."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.times: list[float] = []
        self.event = threading.Event()

    def __call__(self, request_id: str) -> None:
        self.ids.append(request_id)
        self.times.append(time.time())
        self.event.set()
