"""Pinned-host staging (``transport.staging=host``) on CPU: the same staging code as on CUDA,
host memory on both ends, real NIXL transfers between two agents (two pools). Every pull and
push is run with and without staging on either side, and must leave the same bytes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pydantic
import pytest
import torch

from engine.kv_pool import KVLayout
from kv_transport.base import KVTransferTimeout
from kv_transport.config import TransportConfig
from kv_transport.nixl_transport import NixlTransport
from kv_transport.registry import LocalPeerRegistry
from kv_transport.staging import SlotAllocator, StagedDestination, StagedHandle, StagingFullError
from tests.kv_transport.pairs import transport_pair
from tests.waiting import wait_until

LAYOUT = KVLayout(dtype="float32", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
BLOCK_BYTES = 4 * 2 * 8 * 4  # one block of one layer's K (or V)
SLOT_BYTES = 3 * 2 * BLOCK_BYTES  # one block of every layer's K and V
NUM_SLOTS = 12
# (producer staging, consumer staging): the baseline first
MODES = [("none", "none"), ("host", "host"), ("host", "none"), ("none", "host")]


def _pool(num_blocks: int, fill: float | None = None) -> torch.Tensor:
    shape = (3, 2, num_blocks, 4, 2, 8)
    if fill is None:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return torch.full(shape, fill)


@contextmanager
def staged_pair(producer_staging: str, consumer_staging: str, timeout_s: float = 60.0) -> Iterator[tuple]:
    """``(producer, consumer, src, dst, released)``; each side stages as asked, with a buffer
    of ``NUM_SLOTS`` slots. The lease (``timeout_s``) is long: only the tests of its end decide by it."""
    options = dict(peer_check_interval_s=0.0, staging_bytes=NUM_SLOTS * SLOT_BYTES)
    producer_options = {**options, "staging": producer_staging}
    src, dst = _pool(10), _pool(8, fill=-1.0)
    with transport_pair(LAYOUT, src, dst, timeout_s, producer_options, staging=consumer_staging, **options) as pair:
        yield pair[:5]


def _free_slots(*transports: NixlTransport) -> list[int]:
    return [t.staging.slots.num_free for t in transports if t.staging is not None]


def _pull(mode: tuple[str, str]) -> tuple[torch.Tensor, list[int], list[str], object]:
    """Two pulls (one into fresh blocks, one that skips two blocks the consumer holds):
    the consumer's pool after them, the bytes each moved, what was released, the first handle."""
    with staged_pair(*mode) as (producer, consumer, src, dst, released):
        first = producer.export("r1", [2, 3, 4, 9], num_tokens=14, first_token=9)
        stats = [asyncio.run(consumer.fetch(first, [0, 1, 2, 6])).num_bytes]
        dst[:, :, 5] = 7.0  # the consumer's prefix cache holds this request's first block already
        second = producer.export("r2", [8, 1, 0], num_tokens=10, first_token=3)
        stats.append(asyncio.run(consumer.fetch(second, [5, 3, 4], skip_blocks=1)).num_bytes)
        wait_until(lambda: len(released.ids), 30, "both release notices", until=lambda n: n == 2)
        free = _free_slots(producer, consumer)
        assert free == [NUM_SLOTS] * len(free)
        return dst.clone(), stats, sorted(released.ids), first


@pytest.mark.parametrize("mode", MODES[1:], ids=lambda m: f"{m[0]}-to-{m[1]}")
def test_staged_pull_moves_the_same_bytes_and_returns_every_slot(mode):
    baseline, baseline_stats, _, plain = _pull(MODES[0])
    dst, stats, released, handle = _pull(mode)
    src = _pool(10)
    assert torch.equal(baseline[:, :, [0, 1, 2, 6]], src[:, :, [2, 3, 4, 9]])
    assert torch.equal(baseline[:, :, [3, 4]], src[:, :, [1, 0]])
    assert torch.all(baseline[:, :, 5] == 7.0)  # skipped: not overwritten
    assert torch.all(baseline[:, :, 7] == -1.0)  # untouched
    assert torch.equal(dst, baseline)
    assert stats == baseline_stats == [4 * 3 * 2 * BLOCK_BYTES, 2 * 3 * 2 * BLOCK_BYTES]
    assert released == ["r1", "r2"]
    assert not isinstance(plain, StagedHandle)
    # the handle names the producer's pool blocks as any handle does; a staging producer adds slots
    assert handle.block_ids == [2, 3, 4, 9]
    assert isinstance(handle, StagedHandle) == (mode[0] == "host")
    if mode[0] == "host":
        assert handle.staged_ranges == ((0, 4),)  # the lowest free slots, consecutive


def _push(mode: tuple[str, str]) -> tuple[torch.Tensor, list[int], int, object]:
    """A prompt of 5 blocks pushed in two chunks, the first destination block skipped (the
    consumer's cache holds it): the consumer's pool, bytes pushed, the first token, the
    destination."""
    with staged_pair(*mode) as (producer, consumer, src, dst, _):

        async def run():
            dest = consumer.destination("p", [7, 1, 2, 3, 5], num_tokens=18, skip_blocks=1)
            producer.begin_push(dest)
            for layer in range(3):  # chunk 1: blocks 0..2 of the prompt
                producer.push_layer("p", layer, [4, 5, 6], 0)
            for layer in range(3):  # chunk 2: its last block again (half full before), then 2 more
                producer.push_layer("p", layer, [6, 8, 9], 2)
            stats = await producer.finish_push("p", first_token=42)
            done = await consumer.wait_push(dest)
            return stats, done, dest

        stats, done, dest = asyncio.run(run())
        free = _free_slots(producer, consumer)
        assert free == [NUM_SLOTS] * len(free)
        assert [t.layer for t in stats.layer_times] == [0, 1, 2, 0, 1, 2]
        return dst.clone(), stats.num_bytes, done.first_token, dest


@pytest.mark.parametrize("mode", MODES[1:], ids=lambda m: f"{m[0]}-to-{m[1]}")
def test_staged_push_delivers_the_same_blocks_and_returns_every_slot(mode):
    baseline, baseline_bytes, _, _ = _push(MODES[0])
    dst, num_bytes, first_token, dest = _push(mode)
    src = _pool(10)
    assert torch.equal(baseline[:, :, [1, 2, 3, 5]], src[:, :, [5, 6, 8, 9]])
    assert torch.all(baseline[:, :, [0, 4, 6, 7]] == -1.0)  # skipped block 7 and unreserved ones
    assert torch.equal(dst, baseline)
    assert num_bytes == baseline_bytes == (2 + 3) * 3 * 2 * BLOCK_BYTES
    assert first_token == 42
    assert dest.block_ids == [7, 1, 2, 3, 5]  # the consumer decodes from its pool's blocks
    assert isinstance(dest, StagedDestination) == (mode[1] == "host")
    if mode[1] == "host":
        assert dest.staged_ranges == ((0, 4),)  # slots for the four written blocks only


def test_a_staging_transport_publishes_its_buffer_not_its_pool():
    with staged_pair("host", "none") as (producer, consumer, src, dst, _):
        registry = producer._registry
        info = registry.current("prod")
        assert info.mem_type == "DRAM"
        assert info.num_blocks == NUM_SLOTS
        assert info.pool_address == producer.staging.buffer.data_ptr() != src.data_ptr()
        assert tuple(producer.staging.buffer.shape) == (3, 2, NUM_SLOTS, BLOCK_BYTES)
        assert registry.current("cons").pool_address == dst.data_ptr()


def test_a_transfer_needing_more_slots_than_free_is_refused_and_takes_none():
    with staged_pair("host", "host") as (producer, consumer, *_):
        producer.export("big", list(range(8)), num_tokens=32, first_token=1)
        with pytest.raises(StagingFullError, match=r"5 slots needed, 4 of 12 free.*transport.staging_bytes"):
            producer.export("more", [0, 1, 2, 3, 4], num_tokens=20, first_token=1)
        assert producer.staging.slots.num_free == 4
        producer.release("big")
        assert producer.staging.slots.num_free == NUM_SLOTS
        with pytest.raises(StagingFullError, match="13 slots needed"):
            consumer.destination("d", list(range(13)), num_tokens=52)
        assert consumer.staging.slots.num_free == NUM_SLOTS


def test_aborted_pushes_hold_their_slots_until_late_writes_cannot_land():
    with staged_pair("host", "host") as (producer, consumer, *_):
        dest = consumer.destination("a", [0, 1, 2], num_tokens=12)
        producer.begin_push(dest)
        assert producer.staging.slots.num_free == consumer.staging.slots.num_free == NUM_SLOTS - 3
        producer.abort_push("a")  # its own WRITEs: none in flight once aborted here
        consumer.abort_push("a")  # the producer might still write: set aside, not reused yet
        assert producer.staging.slots.num_free == NUM_SLOTS
        assert consumer.staging.slots.num_free == NUM_SLOTS - 3
        assert [len(slots) for _, slots in consumer._slots_later] == [3]


def test_a_push_wait_that_times_out_sets_its_slots_aside_then_frees_them():
    with staged_pair("none", "host", timeout_s=2.0) as (_, consumer, *_):  # set aside for as long
        slots, freed_at, free = consumer.staging.slots, [], consumer.staging.slots.free
        slots.free = lambda ids: (freed_at.append(time.time()), free(ids))
        started = time.time()
        dest = consumer.destination("late", [0, 1, 2], num_tokens=12)
        with pytest.raises(KVTransferTimeout, match="no push completion"):
            asyncio.run(consumer.wait_push(dest))
        wait_until(lambda: slots.num_free, 15, "the set-aside slots freed", until=lambda n: n == NUM_SLOTS)
        # the wait's 2 s, then 2 s more set aside: a late WRITE could land until then
        assert len(freed_at) == 1 and freed_at[0] >= started + 2 * 2.0


def test_bad_staging_values_are_refused_naming_the_setting():
    with pytest.raises(pydantic.ValidationError, match=r"transport.staging must be one of none, host \(got 'gpu'\)"):
        TransportConfig(staging="gpu")
    assert TransportConfig().staging == "none"
    assert TransportConfig(staging="host").staging == "host"
    with pytest.raises(ValueError, match="transport.staging must be one of none, host"):
        NixlTransport("x", LAYOUT, LocalPeerRegistry(), staging="pinned")
    with pytest.raises(ValueError, match=r"transport.staging_bytes=100 holds no block.*1536 bytes"):
        transport = NixlTransport("y", LAYOUT, LocalPeerRegistry(), staging="host", staging_bytes=100)
        try:
            transport.register_pool(_pool(2), lambda rid: None)
        finally:
            transport.close()


def test_slot_allocator_hands_out_lowest_slots_and_refuses_double_frees():
    slots = SlotAllocator(6)
    assert slots.allocate(2, "a", "p") == [0, 1]
    assert slots.allocate(3, "b", "p") == [2, 3, 4]
    slots.free([0, 1])
    assert slots.allocate(3, "c", "p") == [0, 1, 5]
    assert slots.num_free == 0
    with pytest.raises(StagingFullError, match="1 slots needed, 0 of 6 free"):
        slots.allocate(1, "d", "p")
    slots.free([2, 3, 4])
    with pytest.raises(ValueError, match="freed twice"):
        slots.free([3])
    assert slots.num_free == 3


def test_the_apps_transport_section_reaches_the_transport():
    """``transport.staging`` / ``staging_bytes`` as the app passes them (``make_transport``)."""
    from kv_transport.factory import make_transport

    config = TransportConfig(staging="host", staging_bytes=NUM_SLOTS * SLOT_BYTES)
    transport = make_transport(config, "factory", LAYOUT, registry=LocalPeerRegistry())
    try:
        transport.register_pool(_pool(4), lambda rid: None)
        assert transport.staging_kind == "host"
        assert tuple(transport.staging.buffer.shape) == (3, 2, NUM_SLOTS, BLOCK_BYTES)
    finally:
        transport.close()


class FakeCopyEvent:
    """A CUDA copy event (no GPU here): the copy on its side stream ends when the test says."""

    def __init__(self) -> None:
        self.done, self.asked = threading.Event(), threading.Event()

    def query(self) -> bool:
        self.asked.set()
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(15)


def test_a_pull_cancelled_while_its_staged_copy_runs_holds_the_blocks_for_the_copy():
    """Cancelled while the READ's slots are copied into the pool (on CUDA a side stream that a
    cancel does not stop): the slots are set aside and the pool blocks held (``frees_later``),
    so the copy cannot land in blocks given to another request."""
    with staged_pair("none", "host") as (producer, consumer, src, dst, _):
        copy, to_pool = FakeCopyEvent(), consumer.staging.to_pool
        consumer.staging.to_pool = lambda slots, ids: (to_pool(slots, ids), copy)[1]
        handle = producer.export("copying", [2, 3], num_tokens=8, first_token=1)

        async def cancelled() -> None:
            fetching = asyncio.ensure_future(consumer.fetch(handle, [0, 1]))
            assert await asyncio.to_thread(copy.asked.wait, 15)  # the fetch waits for the copy
            fetching.cancel()
            with pytest.raises(asyncio.CancelledError):
                await fetching

        asyncio.run(cancelled())
        assert consumer.frees_later("copying")
        assert consumer.staging.slots.num_free == NUM_SLOTS - 2 and len(consumer._slots_later) == 1
        assert torch.equal(dst[:, :, [0, 1]], src[:, :, [2, 3]])  # what the copy wrote (here at once)
        copy.done.set()


def test_a_copy_into_the_pool_that_failed_while_queued_holds_the_blocks():
    """The copy failed part-way through being queued (a CUDA error): copies already queued may
    still land, so the blocks are held as for a cancel."""
    with staged_pair("none", "host") as (producer, consumer, *_):

        def failing(slots, block_ids):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        consumer.staging.to_pool = failing
        handle = producer.export("broken", [2], num_tokens=4, first_token=1)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            asyncio.run(consumer.fetch(handle, [0]))
        assert consumer.frees_later("broken")
        assert consumer.staging.slots.num_free == NUM_SLOTS - 1  # set aside too
