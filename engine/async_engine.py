"""AsyncEngine: an asyncio front for EngineCore with a step loop on its own thread.

All EngineCore calls run on one engine thread (the core is single-threaded by design). The
thread steps back to back while there is work: commands queued from the event loop are
applied between steps, and each step's outputs reach the per-request asyncio queues with
one ``call_soon_threadsafe``. The next step never waits for the event loop, which is busy
streaming the previous token meanwhile. After each round that stepped or applied a
command the thread publishes an ``EngineStats`` snapshot (``latest_stats``), so other
threads (Serve's routing-stats call) read the load without calling the core. A cancelled
``generate`` or ``decode`` iterator (client gone) aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch

from engine.core import EngineCore
from engine.kv_pool import KVPoolView
from engine.model_runner import LayerHook
from engine.params import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    KVReport,
    PrefillResult,
    RankLostError,
    RequestOutput,
    Role,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)
_Result = tuple[asyncio.Future, Any, BaseException | None]
IDLE_RECHECK_S = 0.05  # a stuck step is retried this often even without a command


class EngineStepError(RuntimeError):
    """A step hit an unexpected error; every request in flight was ended with it (the engine
    keeps serving new requests)."""


class AsyncEngine:
    def __init__(self, core: EngineCore, torch_threads: int | None = None) -> None:
        """``torch_threads``: intra-op threads of the engine thread (default: the creating thread's).

        OpenMP keeps the thread count per OS thread, so a count set in another thread (a
        Serve replica's constructor, say) does not reach the engine thread by itself.
        """
        self.core = core
        self._torch_threads = torch_threads or torch.get_num_threads()
        self._commands: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._latest_stats = core.stats()  # replaced (never mutated) by the engine thread
        self._round_started: float | None = None  # monotonic start of the round in progress

    def start(self) -> None:
        """Start the engine thread; it delivers to the event loop this is called from.

        The engine serves one event loop at a time: another loop may take over only once the
        first is closed.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed() and self._thread is not None:
                raise RuntimeError("this AsyncEngine is serving another event loop")
            self._loop = loop
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._thread_main, name="engine-step", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread after its current step; requests in flight stay where they are."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping = True
            self._wakeup.set()
            await asyncio.to_thread(thread.join)

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
        return await self._call(lambda: self.core.reserve(request_id, num_tokens), request_id)

    async def reserve_prefix(self, request_id: str, prompt_token_ids: Sequence[int]) -> tuple[list[int], int] | None:
        return await self._call(lambda: self.core.reserve_prefix(request_id, prompt_token_ids), request_id)

    async def decode(
        self,
        request: GenerationRequest,
        block_ids: list[int],
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream from reserved blocks holding the prompt's KV; the first item is ``first_token``."""
        queue = self._open_stream(request.request_id)
        admit = lambda: self.core.add_decode(request, block_ids, first_token, first_logprobs)  # noqa: E731
        await self._call(admit, request.request_id)
        async for output in self._drain(request.request_id, queue):
            yield output

    async def release(self, request_id: str) -> bool:
        return await self._call(lambda: self.core.release(request_id))

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self.core.abort(request_id))

    async def set_role(self, role: Role) -> None:
        await self._call(lambda: self.core.set_role(role))

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine thread, between steps (a tensor-parallel engine's commands)."""
        return await self._call(fn)

    async def stats(self) -> EngineStats:
        """Exact stats, taken on the engine thread between steps."""
        return await self._call(self.core.stats)

    async def kv_report(self) -> KVReport:
        """The KV accounting with its invariants checked, taken on the engine thread between steps."""
        return await self._call(self.core.kv_report)

    def health_problem(self, stall_s: float) -> str | None:
        """Why this engine cannot serve (any thread): its thread ended, or one round (a step
        and the commands before it) has run for over ``stall_s``; None when healthy."""
        if self._thread is None:
            return None  # not started yet: the first call starts it
        if not self._thread.is_alive():
            return "the engine thread is not running"
        problem = self.core.health_problem()
        if problem is not None:
            return problem
        started = self._round_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"an engine step has run for {time.monotonic() - started:.0f} s (wedged)"
        return None

    def latest_stats(self) -> EngineStats:
        """The snapshot published after the engine thread's latest step or command; any thread,
        no waiting (it may lag ``stats()`` by the step in progress)."""
        return self._latest_stats

    def pool_view(self) -> KVPoolView:
        """The KV pool's tensor and layout (fixed for the engine's life: any thread)."""
        return self.core.pool.view()

    def add_layer_hook(self, hook: LayerHook) -> None:
        """Call ``hook(layer_idx, chunks)`` on the engine thread after each decoder layer's
        forward. Only before the engine thread starts: the hooks are read inside the forward pass."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("add layer hooks before the engine serves requests")
        self.core.runner.add_layer_hook(hook)

    # ---- plumbing ---------------------------------------------------------------------

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} already exists on this engine")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    async def _call(self, fn: Callable[[], Any], stream_id: str | None = None) -> Any:
        """Run ``fn`` on the engine thread between steps; a failure closes ``stream_id``.

        ``stream_id``: the request ``fn`` admits or reserves blocks for. Cancelled while ``fn``
        waits for the engine thread, the command still runs there: an abort is queued right
        behind it (commands run in order), else the admitted request would run with nobody
        reading its stream, a prefill's blocks would stay pinned and a reservation held,
        for good."""
        self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.append((fn, future))
        self._wakeup.set()
        try:
            return await future
        except BaseException as exc:
            if stream_id is not None:
                self._streams.pop(stream_id, None)
                if isinstance(exc, asyncio.CancelledError):
                    self._commands.append((lambda: self.core.abort(stream_id), loop.create_future()))
                    self._wakeup.set()
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

    def _apply_commands(self) -> list[_Result]:
        results = []
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                results.append((future, fn(), None))
            except Exception as exc:  # returned to the caller that queued it
                results.append((future, None, exc))
        return results

    def _thread_main(self) -> None:
        """The engine thread: apply commands, step, hand the results to the event loop; repeat."""
        torch.set_num_threads(self._torch_threads)
        while not self._stopping:
            self._wakeup.clear()  # cleared before the check: a command queued after it sets it again
            if not self._commands and not self.core.has_work():
                if not self._wakeup.wait(self.core.idle_interval_s):
                    self.core.idle()
                continue
            if not self._round():
                return

    def _round(self) -> bool:
        """One round of the engine thread; False once the event loop is closed."""
        self._round_started = time.monotonic()
        try:
            return self._round_once()
        finally:
            self._round_started = None

    def _round_once(self) -> bool:
        core = self.core
        results = self._apply_commands()
        outputs: list[RequestOutput] = []
        error = None
        progress = (core.num_model_steps, core.num_landings)  # a step that ran the model or landed one
        if core.has_work():
            try:
                outputs = core.step()
            except Exception as exc:  # a bug in the step: fail loudly, keep serving new requests
                core.abort_all()
                error = exc
        stepped = (core.num_model_steps, core.num_landings) != progress
        if results or outputs or error is not None or stepped:
            self._latest_stats = core.stats()  # before delivery: an answered command is in it
        if results or outputs or error is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, results, outputs, error)
            except RuntimeError:  # the event loop is closed: nobody is left to serve
                return False
        elif not stepped:
            # nothing could run (every waiting request needs blocks that pinned or reserved
            # KV holds): only a command (release, abort) changes that, so sleep until one
            self._wakeup.wait(IDLE_RECHECK_S)
        return True

    def _deliver(self, results: list[_Result], outputs: list[RequestOutput], error: Exception | None) -> None:
        """On the event loop: answer the commands, then route the step's outputs."""
        for future, value, exc in results:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(value)
        for output in outputs:
            if output.finish_reason is FinishReason.ERROR:  # the client sees finish_reason "error" only
                logger.warning("request %s ended with an error: %s", output.request_id, output.error)
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        if error is not None:
            self._fail_all(error)

    def _fail_all(self, exc: Exception) -> None:
        lost = isinstance(exc, RankLostError)  # callers tell a lost rank (a replica failure) from a bug
        error = exc if lost else EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        for queue in self._streams.values():
            queue.put_nowait(error)
