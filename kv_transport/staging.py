"""Pinned-host staging of KV (``transport.staging=host``), for clusters without GPUDirect RDMA.

Without GPUDirect RDMA a NIC can neither read nor write GPU memory, so NIXL moves host
memory only: each staging transport registers one host buffer (pinned on CUDA) in place of
its pool, laid out as a small pool of *slots*::

    buffer[num_layers, 2 (K, V), num_slots, block_bytes]      uint8

A slot holds one block of every layer's K and V, so the pool's descriptor arithmetic
(``descriptors.PoolGeometry``) addresses the buffer unchanged, and the peer registry
publishes the buffer instead of the pool (its address, ``num_slots`` as the block count, DRAM).

Who copies what (``NixlTransport`` drives it; callers see no difference):

* producer, pull: ``export`` copies the request's blocks into slots on the side stream (after
  the compute stream's work so far), waits for that copy alone, and hands out a
  ``StagedHandle``: the pool's block ids, as any handle, plus the slots, which the consumer
  reads. The slots are freed with the blocks (release notice, give-back, abort or expiry);
* producer, push: ``begin_push`` takes one slot per block to write; after layer i's compute
  event the side stream copies layer i's blocks into their slots, and layer i's WRITE is
  posted once that copy's event has completed (so after the compute, too);
* consumer, pull: READs into its own slots, then copies them into the pool;
* consumer, push: ``destination`` takes the slots and hands out a ``StagedDestination``; on
  the completion notice ``wait_push`` copies the slots into the pool before returning.

Either side may stage alone: a handle without slots is read from the peer's pool, one with
slots from the peer's buffer.

Bounded by ``transport.staging_bytes``. A transfer that needs more slots than are free is
refused at once with ``StagingFullError`` naming that setting, before anything moves (a clear
error, not back-pressure: waiting for slots would happen on the engine thread or inside a
forward pass, stalling every request of the step; the caller frees its blocks as for any
transfer error).

With cupy installed the pinned buffer is cupy's (handed to torch through DLPack) and the
side stream is a cupy stream (a torch ``ExternalStream`` over it), independent of the
model's framework; without cupy torch's pinned allocation and stream do the same. On a
CPU-only machine the buffer is plain host memory and each copy is a tensor copy done at once:
the same code runs in CI.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Sequence
from typing import Protocol

import torch
from pydantic import Field

from kv_transport.base import KVTransferError
from kv_transport.descriptors import PoolGeometry, coalesce
from kv_transport.handle import KVDestination, KVHandle, from_ranges

logger = logging.getLogger(__name__)

COPY_POLL_S = 0.0002  # an awaited copy-in is checked this often (the event loop stays free)


class CopyEvent(Protocol):
    """What the transport needs of a CUDA event (``torch.cuda.Event`` has it): whether it has
    completed, asked without waiting, and a wait for this one event (never the device)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class StagingFullError(KVTransferError):
    """Not enough free staging slots for a transfer: ``transport.staging_bytes`` is too small for the load."""


class StagedHandle(KVHandle):
    """Pull, from a staging producer: the prompt's blocks in its pool (as any handle) and where
    their copies wait in its staging buffer, which is what a consumer reads."""

    staged_ranges: tuple[tuple[int, int], ...] = Field(
        description="(first slot, count) runs of the producer's staging slots, one per block, in block order"
    )


class StagedDestination(KVDestination):
    """Push, to a staging consumer: the reserved blocks (as any destination) and the staging
    slots the producer writes instead, one per block after ``skip_blocks``."""

    staged_ranges: tuple[tuple[int, int], ...] = Field(
        description="(first slot, count) runs of the consumer's staging slots for the blocks after skip_blocks"
    )


def remote_block_ids(described: KVHandle | KVDestination) -> list[int]:
    """The ids a peer addresses in its owner's published memory, one per block: the staging
    slots of a staged handle or destination, else the pool's blocks. A staged destination's
    first ``skip_blocks`` entries are its pool ids: those blocks are never written."""
    if isinstance(described, StagedHandle):
        return from_ranges(described.staged_ranges)
    if isinstance(described, StagedDestination):
        return described.block_ids[: described.skip_blocks] + from_ranges(described.staged_ranges)
    return described.block_ids


class SlotAllocator:
    """The staging buffer's free slots (pure Python, thread-safe: the engine's event loop
    takes them, the NIXL progress thread may free them). The lowest free slots go first,
    so one request's slots are mostly consecutive (fewer NIXL descriptors)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # sorted
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int, request_id: str, peer: str) -> list[int]:
        """``count`` slots, or ``StagingFullError`` (nothing taken) when fewer are free."""
        with self._lock:
            if count > len(self._free):
                raise StagingFullError(
                    f"staging buffer full: {count} slots needed, {len(self._free)} of {self.num_slots} free "
                    "(raise transport.staging_bytes)",
                    request_id,
                    peer,
                )
            slots, self._free = self._free[:count], self._free[count:]
        return slots

    def free(self, slots: Sequence[int]) -> None:
        with self._lock:
            if not set(slots).isdisjoint(self._free) or len(set(slots)) != len(slots):
                raise ValueError(f"staging slots freed twice: {sorted(slots)}")
            self._free = sorted(self._free + list(slots))


def _cupy():
    """The cupy module, or None where it is not installed (CPU machines, a torch-only GPU image)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def host_buffer(shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    """A zeroed uint8 host tensor; pinned (page-locked, so copies from and to the GPU run
    asynchronously and NIXL can register it) when asked: cupy's allocation through DLPack
    when cupy works, else torch's."""
    if not pinned:
        return torch.zeros(shape, dtype=torch.uint8)
    cupy = _cupy()
    if cupy is not None:
        try:
            import cupyx

            array = cupyx.empty_pinned((math.prod(shape),), dtype="uint8")
            return torch.from_dlpack(array).view(shape).zero_()  # the tensor keeps the array alive
        except Exception as exc:  # e.g. a cupy build for another CUDA: torch's allocator serves
            logger.warning("cupy could not allocate pinned memory (%r); using torch's", exc)
    return torch.zeros(shape, dtype=torch.uint8, pin_memory=True)


class _HostCopies:
    """CPU pools: a copy is done when it returns, so there is no event to wait for."""

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: object | None = None) -> None:
        for dst, src in pairs:
            dst.copy_(src)
        return None


class _CudaCopies:
    """CUDA pools: copies on one side stream (cupy's when cupy works), each batch ordered after
    an event of the compute stream and followed by an event of its own; nothing synchronizes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cupy_stream = None  # kept alive: the torch stream below only wraps it
        cupy = _cupy()
        self.stream: torch.cuda.Stream | None = None
        if cupy is not None:
            try:
                with cupy.cuda.Device(device.index or 0):
                    self._cupy_stream = cupy.cuda.Stream(non_blocking=True)
                self.stream = torch.cuda.ExternalStream(self._cupy_stream.ptr, device=device)
            except Exception as exc:
                logger.warning("cupy stream unavailable (%r); using a torch stream", exc)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: object | None = None) -> torch.cuda.Event:
        """Queue the copies after ``after`` (default: all work queued so far on the current
        stream, i.e. the compute that wrote the blocks); the event that ends them."""
        if after is None:
            after = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return self.stream.record_event()


class HostStaging:
    """One transport's staging buffer over its pool ``[layers, 2, blocks, block_size, heads,
    head_dim]``, its free slots, and the copies between the two."""

    def __init__(self, pool: torch.Tensor, num_layers: int, staging_bytes: int) -> None:
        num_blocks = pool.shape[2]
        self._pool = pool.view(torch.uint8).view(num_layers, 2, num_blocks, -1)  # one byte row per block
        block_bytes = self._pool.shape[3]
        slot_bytes = 2 * num_layers * block_bytes
        num_slots = staging_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"transport.staging_bytes={staging_bytes} holds no block: one block of every layer's K and V "
                f"takes {slot_bytes} bytes"
            )
        self.num_layers = num_layers
        self.buffer = host_buffer((num_layers, 2, num_slots, block_bytes), pinned=pool.is_cuda)
        self.slots = SlotAllocator(num_slots)
        self._copies = _CudaCopies(pool.device) if pool.is_cuda else _HostCopies()

    def geometry(self) -> PoolGeometry:
        """Where the slots are, for NIXL descriptors (host memory: device id 0)."""
        _, _, num_slots, block_bytes = self.buffer.shape
        return PoolGeometry(self.buffer.data_ptr(), self.num_layers, num_slots, block_bytes, 0)

    def to_host(
        self,
        block_ids: Sequence[int],
        slots: Sequence[int],
        layers: Sequence[int] | None = None,
        after: object | None = None,
    ) -> CopyEvent | None:
        """Copy pool blocks into slots (``layers``: all when None) once ``after`` (an event of the
        compute stream) has completed; returns the copy's event (None: done already, on CPU)."""
        return self._copies.copy(self._pairs(self.buffer, slots, self._pool, block_ids, layers), after)

    def to_pool(self, slots: Sequence[int], block_ids: Sequence[int]) -> CopyEvent | None:
        """Copy slots into pool blocks, every layer; returns the copy's event (None: done already)."""
        return self._copies.copy(self._pairs(self._pool, block_ids, self.buffer, slots, None))

    def _pairs(
        self,
        dst: torch.Tensor,
        dst_ids: Sequence[int],
        src: torch.Tensor,
        src_ids: Sequence[int],
        layers: Sequence[int] | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One contiguous ``[count, block_bytes]`` copy per (layer, K/V, run of consecutive ids)."""
        runs = coalesce(src_ids, dst_ids)
        layer_ids = range(self.num_layers) if layers is None else layers
        return [
            (dst[layer, kv, d : d + n], src[layer, kv, s : s + n])
            for layer in layer_ids
            for kv in (0, 1)
            for s, d, n in runs
        ]


def wait_copied_now(event: CopyEvent | None) -> None:
    """Block on one copy's event only (never the device); None: nothing to wait for."""
    if event is not None:
        event.synchronize()


async def wait_copied(event: CopyEvent | None) -> None:
    """Wait for one copy's event without blocking the event loop (None: done already)."""
    while event is not None and not event.query():
        await asyncio.sleep(COPY_POLL_S)
