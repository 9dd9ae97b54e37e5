"""KVEngineLink: one engine and its transport, in the engine's process.

The prefill/decode halves of a disaggregated request, each a few lines over the engine
and the transport; the Serve deployments call these. Block ownership:

* pull: prefill pins its blocks and exports a handle; the transport releases them when
  the consumer's notice arrives, on ``kv_transfer_timeout_s``, or on abort. Decode reserves
  local blocks, fetches, then decodes; if the fetch fails, its reserved blocks are freed (a
  READ still posted: once it ends).
  When decode has no free blocks, the request waits here for them while the producer's
  lease lasts (its handle's expiry less ``LEASE_MARGIN_S``), then fails with
  ``KVCapacityError``.
* push: decode reserves blocks and returns a destination; prefill writes each layer into
  them during its forward pass, then notifies, then frees its own blocks. Decode waits for
  the notice, then decodes. A push that ends before its notice (a failure, a timeout, the
  request gone) keeps the reservation until its producer's notice comes (sent once none of
  its WRITEs can land) or its destination expires (none is posted after that), so no WRITE
  lands in blocks given to another request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.params import GenerationRequest, PrefillResult, RequestOutput, TokenLogprobs
from engine.scheduler import ScheduledChunk
from kv_transport.base import BaseKVTransport, KVCapacityError, KVTransferError, TransferStats
from kv_transport.handle import KVDestination, KVHandle

logger = logging.getLogger(__name__)

LEASE_MARGIN_S = 1.0  # time kept for the fetch itself when waiting for decode blocks


@dataclass(frozen=True)
class DecodeTimings:
    """A decode request's parts of TTFT on this replica: the wait for KV blocks and, for a
    pull, the fetch (a push's transfer is timed by its producer)."""

    decode_queue_s: float
    kv_transfer_s: float | None = None
    kv_bytes: int | None = None


class KVEngineLink:
    def __init__(self, engine: AsyncEngine, transport: BaseKVTransport, push_pipelined: bool = True) -> None:
        """Construct inside the engine's running event loop.

        ``push_pipelined=False`` sends all layers after the forward pass instead of each
        layer right after its own forward (a baseline for the pipelining benchmark).
        """
        self.engine = engine
        self.transport = transport
        self.push_pipelined = push_pipelined

        self._loop = asyncio.get_running_loop()
        self._pushing: set[str] = set()
        self._push_errors: dict[str, BaseException] = {}
        self.last_fetch: TransferStats | None = None
        self._timings: dict[str, DecodeTimings] = {}  # until taken, or the request ends
        pool = engine.pool_view()
        self._block_size = pool.block_size
        self._num_layers = pool.layout.num_layers
        transport.register_pool(pool.tensor, self._release_from_transport)
        if transport.supports_push:
            engine.add_layer_hook(self._after_layer)

    def close(self) -> None:
        self.transport.close()

    def pop_decode_timings(self, request_id: str) -> DecodeTimings | None:
        """The request's ``DecodeTimings``, once: there from the moment its KV is in place (pull)
        or its blocks are reserved (push) until taken or the request ends."""
        return self._timings.pop(request_id, None)

    # ---- pull -------------------------------------------------------------------------

    async def prefill_pull(self, request: GenerationRequest) -> tuple[PrefillResult, KVHandle | None]:
        """Prefill and export. No handle when the request already ended at its first token."""
        result = await self.engine.prefill(request)
        if result.finish_reason is not None:
            return result, None
        try:
            handle = self.transport.export(
                request.request_id, list(result.block_ids), result.num_tokens, result.first_token
            )
        except BaseException:
            await self.engine.release(request.request_id)
            raise
        return result, handle

    async def decode_pull(
        self, request: GenerationRequest, handle: KVHandle, first_logprobs: TokenLogprobs | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Fetch the producer's KV, then decode from its first token (``first_logprobs``: that
        token's log-probabilities, from the prefill result, when the request asked for them)."""
        start = time.perf_counter()
        try:
            blocks, cached = await self._reserve(request, wait_until=handle.expires_at - LEASE_MARGIN_S)
        except BaseException:  # no room, or the request went away: the producer frees its copy now
            self.transport.give_back(handle)
            raise
        reserved = time.perf_counter()
        try:
            self.last_fetch = stats = await self.transport.fetch(handle, blocks, cached)
        except BaseException:
            self.transport.give_back(handle)
            await self._free_unfinished(request.request_id)
            raise
        self._timings[request.request_id] = DecodeTimings(
            decode_queue_s=reserved - start, kv_transfer_s=stats.seconds, kv_bytes=stats.num_bytes
        )
        try:
            async for output in self.engine.decode(request, blocks, handle.first_token, first_logprobs):
                yield output
        finally:
            self._timings.pop(request.request_id, None)

    # ---- push -------------------------------------------------------------------------

    async def reserve_push(self, request: GenerationRequest) -> KVDestination:
        start = time.perf_counter()
        blocks, cached = await self._reserve(request)
        self._timings[request.request_id] = DecodeTimings(decode_queue_s=time.perf_counter() - start)
        return self.transport.destination(request.request_id, blocks, len(request.prompt_token_ids), cached)

    async def prefill_push(
        self, request: GenerationRequest, destination: KVDestination
    ) -> tuple[PrefillResult, TransferStats]:
        rid = request.request_id
        self.transport.begin_push(destination)
        self._pushing.add(rid)
        try:
            result = await self.engine.prefill(request)
        except BaseException:
            self.transport.abort_push(rid)
            raise
        finally:
            self._pushing.discard(rid)
        try:
            error = self._push_errors.pop(rid, None)
            if error is not None:
                raise error
            # pipelined, the layer hook wrote the blocks this prefill computed; the ones its
            # prefix cache supplied go now (the transport skips those the consumer holds)
            unwritten = result.block_ids if not self.push_pipelined else result.block_ids[: self._cached_blocks(result)]
            if unwritten:
                for layer in range(self._num_layers):
                    self.transport.push_layer(rid, layer, list(unwritten), 0)
            stats = await self.transport.finish_push(rid, result.first_token, result.first_logprobs)
        except BaseException:
            self.transport.abort_push(rid)  # the consumer hears now (none left after finish_push)
            raise
        finally:
            await self.engine.release(rid)
        return result, stats

    async def decode_push(self, request: GenerationRequest, destination: KVDestination) -> AsyncIterator[RequestOutput]:
        try:
            completion = await self.transport.wait_push(destination)
        except BaseException:
            await self.drop_push(request.request_id)
            raise
        try:
            first = completion.first_token, completion.first_logprobs
            async for output in self.engine.decode(request, destination.block_ids, *first):
                yield output
        finally:
            self._timings.pop(request.request_id, None)

    async def drop_push(self, request_id: str) -> None:
        """Consumer: a push into reserved blocks ends before its completion (a failure, the
        request gone); its blocks are freed once its producer can no longer write into them."""
        self._timings.pop(request_id, None)
        self.transport.abort_push(request_id)
        await self._free_unfinished(request_id)

    async def abort(self, request_id: str) -> None:
        """Drop the request on this engine: running, pinned for export, reserved, or pushing."""
        self._timings.pop(request_id, None)
        self.transport.abort_push(request_id)
        self.transport.release(request_id)
        await self.engine.abort(request_id)

    # ---- internals --------------------------------------------------------------------

    def _cached_blocks(self, result: PrefillResult) -> int:
        """Leading blocks of a prefill that its prefix cache supplied (not computed, so never
        seen by the layer hook)."""
        return result.num_cached_tokens // self._block_size

    async def _reserve(self, request: GenerationRequest, wait_until: float = 0.0) -> tuple[list[int], int]:
        """Reserve blocks for the prompt's KV, sharing what this replica's prefix cache holds:
        (the blocks, how many leading ones hold their KV already). Polls for free blocks until
        ``wait_until`` (unix time)."""
        pause, rid, prompt = 0.01, request.request_id, request.prompt_token_ids
        reserved = await self.engine.reserve_prefix(rid, prompt)
        while reserved is None and time.time() + pause < wait_until:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
            reserved = await self.engine.reserve_prefix(rid, prompt)
        if reserved is None:
            stats = await self.engine.stats()
            raise KVCapacityError(
                f"no room for {len(prompt)} tokens of KV for request {rid}: "
                f"{stats.num_free_blocks} of {stats.num_total_blocks} blocks free"
            )
        return reserved

    async def _free_unfinished(self, request_id: str) -> None:
        """Free the blocks an unfinished transfer was filling: now, or by the transport once
        nothing can land in them (a late write into blocks given to another request would
        corrupt its KV)."""
        if not self.transport.frees_later(request_id):
            await self.engine.release(request_id)

    def _release_from_transport(self, request_id: str) -> None:
        """Called from the transport's thread: free the pinned blocks on the engine's loop."""
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.engine.release(request_id)))

    def _after_layer(self, layer: int, chunks: Sequence[ScheduledChunk]) -> None:
        """Engine thread, inside the forward pass: post this layer's writes for pushing requests."""
        if not self._pushing or not self.push_pipelined:
            return
        block_size = self._block_size
        for chunk in chunks:
            rid = chunk.request_id
            if rid not in self._pushing or not chunk.in_prompt:
                continue
            first = chunk.start_pos // block_size
            last = -(-(chunk.start_pos + len(chunk.token_ids)) // block_size)
            try:
                self.transport.push_layer(rid, layer, chunk.block_ids[first:last], first)
            except KVTransferError as exc:  # surfaced by prefill_push after the step
                self._pushing.discard(rid)
                self._push_errors[rid] = exc
