"""The naive baseline: KV bytes through Ray's object store (pull only).

``export`` copies the request's blocks out of the pool into one tensor, puts it in the
object store, and frees the blocks at once (the copy holds the KV). The handle carries
the object reference: the one place where Ray carries KV bytes, kept for comparison and
for clusters without NIXL.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import ConfigDict, Field

from engine.kv_pool import KVLayout
from engine.params import TokenLogprobs
from kv_transport.base import (
    BaseKVTransport,
    KVTransferError,
    KVTransferTimeout,
    LayoutMismatchError,
    PushCompletion,
    ReleaseBlocks,
    TransferStats,
)
from kv_transport.handle import KVDestination, KVHandle


class ObjectStoreKVHandle(KVHandle):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    object_ref: Any = Field(description="Ray ObjectRef of the request's KV blocks")


class ObjectStoreTransport(BaseKVTransport):
    supports_push = False

    def __init__(self, engine_id: str, layout: KVLayout, kv_transfer_timeout_s: float = 60.0) -> None:
        self.engine_id = engine_id
        self.incarnation = f"{time.time_ns():x}"
        self.layout = layout
        self.timeout_s = kv_transfer_timeout_s
        self._pool: torch.Tensor | None = None
        self._release_blocks: ReleaseBlocks | None = None

    def register_pool(self, pool: torch.Tensor, release_blocks: ReleaseBlocks) -> None:
        self._pool = pool
        self._release_blocks = release_blocks

    def export(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int) -> KVHandle:
        import ray

        index = torch.tensor(block_ids, device=self._pool.device)
        ref = ray.put(self._pool[:, :, index].cpu())
        self._release_blocks(request_id)  # the copy in the object store holds the KV now
        expires_at = time.time() + self.timeout_s
        return ObjectStoreKVHandle.of_blocks(
            self, request_id, block_ids, num_tokens, expires_at, first_token=first_token, object_ref=ref
        )

    async def fetch(self, handle: KVHandle, local_block_ids: list[int], skip_blocks: int = 0) -> TransferStats:
        import asyncio

        if handle.layout != self.layout:
            raise LayoutMismatchError("KV layout mismatch", handle.request_id, handle.engine_id)
        if not isinstance(handle, ObjectStoreKVHandle):
            raise KVTransferError("not an object-store handle", handle.request_id, handle.engine_id)
        start = time.perf_counter()
        try:
            async with asyncio.timeout(max(0.0, handle.seconds_left())):  # a cancel stays a cancel (not wait_for)
                blocks = await handle.object_ref
        except TimeoutError:
            raise KVTransferTimeout("object store get timed out", handle.request_id, handle.engine_id) from None
        blocks = blocks[:, :, skip_blocks:]  # the leading ones are in this replica's prefix cache
        index = torch.tensor(local_block_ids[skip_blocks:], device=self._pool.device)
        self._pool[:, :, index] = blocks.to(self._pool.device)
        num_bytes = blocks.numel() * blocks.element_size()
        return TransferStats(num_bytes=num_bytes, seconds=time.perf_counter() - start, num_descriptors=1)

    def release(self, request_id: str) -> None:
        """Nothing is pinned after ``export``."""

    def close(self) -> None:
        """Object references are freed by Ray's reference counting."""

    def _no_push(self, request_id: str) -> KVTransferError:
        return KVTransferError("the object-store transport supports pull only", request_id, self.engine_id)

    def destination(
        self, request_id: str, block_ids: list[int], num_tokens: int, skip_blocks: int = 0
    ) -> KVDestination:
        raise self._no_push(request_id)

    def begin_push(self, destination: KVDestination) -> None:
        raise self._no_push(destination.request_id)

    def push_layer(self, request_id: str, layer: int, local_block_ids: Sequence[int], start_index: int) -> None:
        raise self._no_push(request_id)

    async def finish_push(
        self, request_id: str, first_token: int, first_logprobs: TokenLogprobs | None = None
    ) -> TransferStats:
        raise self._no_push(request_id)

    async def wait_push(self, destination: KVDestination) -> PushCompletion:
        raise self._no_push(destination.request_id)

    def abort_push(self, request_id: str) -> None:
        """No push state to drop."""
