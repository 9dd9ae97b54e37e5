"""AsyncEngine: an asyncio front for EngineCore with a background step loop.

All EngineCore calls run on one worker thread (the core is single-threaded by design):
commands queued from the event loop are applied between steps, and each step's outputs
are dispatched to per-request asyncio queues. A cancelled ``generate`` or ``decode``
iterator (client gone) aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine.core import EngineCore
from engine.params import EngineStats, FinishReason, GenerationRequest, PrefillResult, RequestOutput, Role


class EngineDeadError(RuntimeError):
    """The step loop hit an unexpected error; every request in flight was ended with it."""


class AsyncEngine:
    def __init__(self, core: EngineCore, torch_threads: int | None = None) -> None:
        """``torch_threads``: intra-op threads of the step thread (default: the creating thread's).

        OpenMP keeps the thread count per OS thread, so a count set in another thread (a
        Serve replica's constructor, say) does not reach the step thread by itself.
        """
        self.core = core
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="engine-step",
            initializer=torch.set_num_threads,
            initargs=(torch_threads or torch.get_num_threads(),),
        )
        self._commands: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._executor.shutdown(wait=True)

    # ---- public API -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the whole request's outputs (roles decode and both)."""
        queue = self._open_stream(request.request_id)
        await self._call(lambda: self.core.add_request(request), request.request_id)
        async for output in self._drain(request.request_id, queue):
            yield output

    async def prefill(self, request: GenerationRequest) -> PrefillResult:
        """Run the prompt; returns the first token and the pinned block ids."""
        queue = self._open_stream(request.request_id)
        await self._call(lambda: self.core.add_prefill(request), request.request_id)
        final = None
        async for output in self._drain(request.request_id, queue):
            final = output
        if final.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            raise RuntimeError(final.error or f"prefill of {request.request_id} ended: {final.finish_reason.value}")
        return PrefillResult.from_output(final)

    async def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        return await self._call(lambda: self.core.reserve(request_id, num_tokens))

    async def decode(
        self, request: GenerationRequest, block_ids: list[int], first_token: int
    ) -> AsyncIterator[RequestOutput]:
        """Stream from reserved blocks holding the prompt's KV; the first item is ``first_token``."""
        queue = self._open_stream(request.request_id)
        await self._call(lambda: self.core.add_decode(request, block_ids, first_token), request.request_id)
        async for output in self._drain(request.request_id, queue):
            yield output

    async def release(self, request_id: str) -> bool:
        return await self._call(lambda: self.core.release(request_id))

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self.core.abort(request_id))

    async def set_role(self, role: Role | str) -> None:
        await self._call(lambda: self.core.set_role(role))

    async def stats(self) -> EngineStats:
        return await self._call(self.core.stats)

    # ---- plumbing ---------------------------------------------------------------------

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} already exists on this engine")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    async def _call(self, fn: Callable[[], Any], stream_id: str | None = None) -> Any:
        """Run ``fn`` on the engine thread between steps; a failure closes ``stream_id``."""
        self.start()
        future = asyncio.get_running_loop().create_future()
        self._commands.append((fn, future))
        self._wakeup.set()
        try:
            return await future
        except BaseException:
            if stream_id is not None:
                self._streams.pop(stream_id, None)
            raise

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (cancelled, closed): free everything
                await asyncio.shield(self._call(lambda: self.core.abort(request_id)))

    def _apply_commands(self) -> list[tuple[asyncio.Future, Any, BaseException | None]]:
        results = []
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                results.append((future, fn(), None))
            except Exception as exc:  # returned to the caller that queued it
                results.append((future, None, exc))
        return results

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._commands and not self.core.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
            results = await loop.run_in_executor(self._executor, self._apply_commands)
            for future, value, exc in results:
                if not future.done():
                    future.set_exception(exc) if exc is not None else future.set_result(value)
            if not self.core.has_work():
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.core.step)
            except Exception as exc:  # a bug in the step: fail loudly, keep serving new requests
                await loop.run_in_executor(self._executor, self.core.abort_all)
                self._fail_all(exc)
                continue
            for output in outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)

    def _fail_all(self, exc: Exception) -> None:
        error = EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}")
        for queue in self._streams.values():
            queue.put_nowait(error)
