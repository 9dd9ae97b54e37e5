"""Background loops of a deployment (the controller's decisions, the ingress's sync, a
replica's reports): started once, restarted if they ended, each in a context of its own."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any


def keep_running(task: asyncio.Task | None, start: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task:
    """``task`` while it runs, else a new task of ``start()`` in an empty context: the call that
    happened to start it would otherwise lend it its request id (its log lines, its calls)."""
    if task is not None and not task.done():
        return task
    return asyncio.get_running_loop().create_task(start(), context=contextvars.Context())
