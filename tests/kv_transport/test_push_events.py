"""Layer-pipelined push, the CUDA ordering rule checked on CPU: layer i's WRITE is posted
only once layer i's compute event has completed, in layer order, and nothing waits on the
device. The GPU's events are replaced by ``FakeCudaEvent`` (the GPU is outside this
machine); the transfers are real NIXL transfers between two CPU pools."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import torch

from engine.kv_pool import KVLayout
from kv_transport.nixl_worker import Post, PostedAt, PostQueue
from tests.kv_transport.pairs import transport_pair
from tests.waiting import wait_until, wait_until_async

LAYOUT = KVLayout(dtype="float32", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
ROUNDS = 5  # progress rounds a post would have been made in, had its event been ignored


class RoundCounter:
    """Counts the progress thread's rounds (each drains the outbox: a ready post is made in
    the first one), so a test waits for rounds instead of a guessed time."""

    def __init__(self, worker) -> None:
        self.count = 0
        round_ = worker._round

        def counted(*args):
            interval = round_(*args)
            self.count += 1
            return interval

        worker._round = counted

    async def rounds(self, n: int) -> None:
        start = self.count
        await wait_until_async(lambda: self.count, 30, f"{n} progress rounds", until=lambda c: c >= start + n)


class FakeCudaEvent:
    """A CUDA event whose completion the test decides. It has ``record`` and ``query`` only,
    so anything that would wait on it (``synchronize``, ``wait``) fails loudly."""

    def __init__(self) -> None:
        self.recorded = False
        self._done = threading.Event()

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()


class FakeCudaEvents:
    """The ``event_type`` given to the transport: makes ``FakeCudaEvent``s and keeps them in order."""

    def __init__(self) -> None:
        self.made: list[FakeCudaEvent] = []

    def __call__(self) -> FakeCudaEvent:
        event = FakeCudaEvent()
        self.made.append(event)
        return event


@pytest.fixture
def no_device_sync(monkeypatch):
    """Any device-wide synchronize fails the test (there is no device here to synchronize)."""
    calls: list[str] = []

    def fake_synchronize(*args: object) -> None:
        calls.append("torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", fake_synchronize)
    yield calls
    assert calls == [], "a device-wide synchronize was called"


def _post(name: str, event: FakeCudaEvent | None) -> Post:
    return Post("WRITE", [], [], "peer", "peer", "DRAM", name, concurrent.futures.Future(), PostedAt(), event)


def test_queue_posts_nothing_before_the_heads_event_and_keeps_layer_order(no_device_sync):
    events = [FakeCudaEvent() for _ in range(3)]
    queue = PostQueue()
    for layer, event in enumerate(events):
        queue.append(_post(f"layer{layer}", event))
    assert queue.pop_ready() == []
    events[2].complete()  # out of order: the last layer's compute ends first
    events[1].complete()
    assert queue.pop_ready() == [] and len(queue) == 3
    events[0].complete()
    assert [p.request_id for p in queue.pop_ready()] == ["layer0", "layer1", "layer2"]
    assert not queue


def test_queue_releases_a_prefix_and_a_post_without_event_waits_its_turn():
    first, second = FakeCudaEvent(), FakeCudaEvent()
    queue = PostQueue()
    for post in (_post("l0", first), _post("read", None), _post("l1", second), _post("read2", None)):
        queue.append(post)
    first.complete()
    assert [p.request_id for p in queue.pop_ready()] == ["l0", "read"]
    assert queue.pop_ready() == []  # "read2" waits behind layer 1
    second.complete()
    assert [p.request_id for p in queue.pop_ready()] == ["l1", "read2"]


def _pool(num_blocks: int, fill: float | None = None) -> torch.Tensor:
    shape = (3, 2, num_blocks, 4, 2, 8)
    if fill is None:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return torch.full(shape, fill)


def test_push_writes_each_layer_only_after_its_event_in_layer_order(no_device_sync):
    events = FakeCudaEvents()
    with transport_pair(LAYOUT, _pool(6), _pool(6, fill=-1.0), 30.0) as (producer, consumer, src, dst, _, _):
        producer._event_type = events  # what a CUDA pool gets as torch.cuda.Event
        counter = RoundCounter(producer._worker)

        async def run():
            dest = consumer.destination("p", [4, 5], num_tokens=6)
            producer.begin_push(dest)
            for layer in range(3):
                producer.push_layer("p", layer, [1, 2], 0)
            assert [e.recorded for e in events.made] == [True, True, True]
            push = producer._push_out["p"]
            await counter.rounds(ROUNDS)
            assert [r.posted_at.unix_s for r in push.layers] == [None, None, None]
            assert torch.all(dst == -1.0)  # nothing written before any compute ended
            events.made[2].complete()
            events.made[1].complete()
            await counter.rounds(ROUNDS)
            assert [r.posted_at.unix_s for r in push.layers] == [None, None, None]  # layer 0 holds them
            assert torch.all(dst == -1.0)
            events.made[0].complete()
            wait_until(lambda: push.layers[-1].posted_at.unix_s, 30, "the last layer's WRITE posted")
            stats = await producer.finish_push("p", first_token=5)
            done = await consumer.wait_push(dest)
            return stats, done

        stats, done = asyncio.run(run())
    assert done.first_token == 5
    assert torch.equal(dst[:, :, [4, 5]], src[:, :, [1, 2]])
    assert torch.all(dst[:, :, :4] == -1.0)
    posted = [t.posted for t in stats.layer_times]
    assert [t.layer for t in stats.layer_times] == [0, 1, 2]
    assert posted == sorted(posted)  # posted in layer order although layer 2's event ended first
