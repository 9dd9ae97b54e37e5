"""NixlTransport on GPU memory: the byte-exact checks of tests/kv_transport/test_nixl_local.py
(two agents in one process) with both pools as CUDA bfloat16 tensors, registered as VRAM, and
the same through pinned host staging buffers (``transport.staging=host``).

The cross-process figures (raw READ against our pull, push tail) are in ``bench.gpu_kv``.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading

import pytest
import torch

from engine.kv_pool import KVLayout
from kv_transport.descriptors import PoolGeometry
from tests.kv_transport.pairs import transport_pair

pytestmark = pytest.mark.cuda

LAYOUT = KVLayout(dtype="bfloat16", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
SHAPE = (3, 2)  # layers, K/V; then blocks, block_size, heads, head_dim
BLOCK_BYTES = 4 * 2 * 8 * 2  # one block of one layer's K (or V), bfloat16


def _pool(num_blocks: int, fill: float | None = None, seed: int = 0) -> torch.Tensor:
    shape = (*SHAPE, num_blocks, 4, 2, 8)
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16)


@pytest.fixture
def pair(monkeypatch):
    # both agents are in this process: UCX's cuda_ipc serves its own process only when asked
    # (UCX's own loopback tests set this), read when each agent's UCX context is made
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_SAME_PROCESS", "y")
    src, dst = _pool(8), _pool(6, fill=-1.0)
    torch.cuda.synchronize()  # the pools' contents are written before any transfer reads them
    with transport_pair(LAYOUT, src, dst, 5.0) as transports:
        yield transports


def test_cuda_pool_is_published_as_vram_with_its_device(pair):
    producer, _, src, _, _, registry = pair
    info = registry.current("prod")
    assert info.mem_type == "VRAM"
    assert info.device_id == src.device.index
    assert info.pool_address == src.data_ptr()
    # the descriptors a consumer builds from that entry, and the producer's own, name that device
    remote = PoolGeometry(info.pool_address, 3, info.num_blocks, BLOCK_BYTES, info.device_id).descs([(2, 3)])
    assert [(addr - src.data_ptr(), length, dev) for addr, length, dev in remote[:2]] == [
        (2 * BLOCK_BYTES, 3 * BLOCK_BYTES, src.device.index),
        (8 * BLOCK_BYTES + 2 * BLOCK_BYTES, 3 * BLOCK_BYTES, src.device.index),
    ]
    assert producer._worker.local_mem_type == "VRAM"
    assert producer._worker.cuda_device == src.device.index


def test_bind_cuda_makes_a_context_current_in_a_new_thread(pair):
    producer, *_ = pair
    libcuda = ctypes.CDLL("libcuda.so.1")
    contexts: list[int | None] = []

    def run() -> None:
        producer._worker.bind_cuda()
        ctx = ctypes.c_void_p()
        assert libcuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        contexts.append(ctx.value)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert len(contexts) == 1 and contexts[0], "no CUDA context current in the thread after bind_cuda"


def test_pull_copies_exact_blocks_and_releases_the_producer(pair):
    producer, consumer, src, dst, released, _ = pair
    handle = producer.export("r1", [2, 3, 4, 7], num_tokens=14, first_token=9)
    stats = asyncio.run(consumer.fetch(handle, [0, 1, 2, 5]))
    assert torch.equal(dst[:, :, [0, 1, 2, 5]], src[:, :, [2, 3, 4, 7]])
    assert torch.all(dst[:, :, [3, 4]] == -1)  # untouched
    assert stats.num_bytes == 3 * 2 * 4 * BLOCK_BYTES
    assert stats.num_descriptors == 3 * 2 * 2  # runs (2..4 -> 0..2) and (7 -> 5), per layer and K/V
    assert released.event.wait(5) and released.ids == ["r1"]


def _push_behind_gpu_sleeps(producer, consumer, src: torch.Tensor, fresh: torch.Tensor, rid: str):
    """Push 3 layers of blocks 6-7 into the consumer's blocks 4-5, each layer's bytes written on a
    compute stream behind ~1 ms of GPU sleep; returns (finish_push's stats, wait_push's completion)."""
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()

    async def run():
        dest = consumer.destination(rid, [4, 5], num_tokens=6)
        producer.begin_push(dest)
        for layer in range(3):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the layer's KV exists
                src[layer, :, 6:8].copy_(fresh[layer])
                producer.push_layer(rid, layer, [6, 7], start_index=0)
        stats = await producer.finish_push(rid, first_token=42)
        done = await consumer.wait_push(dest)
        return stats, done

    result = asyncio.run(run())
    torch.cuda.synchronize()
    return result


def test_push_waits_for_each_layers_compute_and_delivers_exact_blocks(pair):
    """Each layer's source blocks are written on a compute stream behind a GPU sleep, then
    pushed: the write must wait for the layer's event, so the consumer gets the new bytes."""
    producer, consumer, src, dst, _, _ = pair
    fresh = _pool(2, seed=1)  # [layers, K/V, 2 blocks, ...]: what each layer's compute writes
    stats, done = _push_behind_gpu_sleeps(producer, consumer, src, fresh, "chat:p")
    assert done.first_token == 42
    assert torch.equal(dst[:, :, [4, 5]], fresh)
    assert torch.equal(src[:, :, [6, 7]], fresh)
    assert torch.all(dst[:, :, :4] == -1)  # untouched
    assert stats.num_bytes == 3 * 2 * 2 * BLOCK_BYTES
    assert [t.layer for t in stats.layer_times] == [0, 1, 2]
    assert all(t.compute_end <= t.posted <= t.done for t in stats.layer_times)


@pytest.fixture
def staged_pair(monkeypatch):
    """Both transports stage through pinned host buffers (``transport.staging=host``)."""
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_SAME_PROCESS", "y")
    src, dst = _pool(8), _pool(6, fill=-1.0)
    torch.cuda.synchronize()
    options = dict(staging="host", staging_bytes=16 * 3 * 2 * BLOCK_BYTES)
    with transport_pair(LAYOUT, src, dst, 5.0, producer_options=options, **options) as transports:
        yield transports


def test_staging_buffers_are_pinned_host_memory_published_as_dram(staged_pair):
    producer, consumer, src, _, _, registry = staged_pair
    info = registry.current("prod")
    assert info.mem_type == "DRAM" and info.device_id == 0
    assert info.pool_address == producer.staging.buffer.data_ptr() != src.data_ptr()
    assert producer.staging.buffer.is_pinned() and not producer.staging.buffer.is_cuda
    assert producer._worker.local_mem_type == "DRAM"
    assert producer._worker.cuda_device == src.device.index  # the copies still run on the pool's GPU


def test_staged_pull_copies_exact_blocks_and_returns_every_slot(staged_pair):
    producer, consumer, src, dst, released, _ = staged_pair
    handle = producer.export("r1", [2, 3, 4, 7], num_tokens=14, first_token=9)
    stats = asyncio.run(consumer.fetch(handle, [0, 1, 2, 5]))
    torch.cuda.synchronize()
    assert torch.equal(dst[:, :, [0, 1, 2, 5]], src[:, :, [2, 3, 4, 7]])
    assert torch.all(dst[:, :, [3, 4]] == -1)
    assert stats.num_bytes == 3 * 2 * 4 * BLOCK_BYTES
    assert released.event.wait(5) and released.ids == ["r1"]
    assert producer.staging.slots.num_free == consumer.staging.slots.num_free == 16


def test_staged_push_copies_each_layer_after_its_compute_event(staged_pair):
    """As the unstaged push test: each layer's blocks are written on a compute stream behind a
    GPU sleep; the side stream's copy into the pinned buffer must wait for the layer's event."""
    producer, consumer, src, dst, _, _ = staged_pair
    fresh = _pool(2, seed=1)
    stats, done = _push_behind_gpu_sleeps(producer, consumer, src, fresh, "chat:s")
    assert done.first_token == 42
    assert torch.equal(dst[:, :, [4, 5]], fresh)
    assert torch.all(dst[:, :, :4] == -1)
    assert stats.num_bytes == 3 * 2 * 2 * BLOCK_BYTES
    assert producer.staging.slots.num_free == consumer.staging.slots.num_free == 16
