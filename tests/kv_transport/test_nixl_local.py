"""Real NIXL transfers between two agents (two pools) in one process: fast checks of the
byte movement, release notices, timeouts, layout refusal and re-handshakes. The
cross-process tests with engines are in test_disaggregated.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time

import pytest
import torch

from engine.kv_pool import KVLayout
from engine.params import TokenLogprobs
from kv_transport.base import KVTransferError, KVTransferTimeout, LayoutMismatchError, ReadStillPosted, StalePeerError
from kv_transport.faults import FaultPoints
from kv_transport.handle import RankPeer
from kv_transport.heads import HeadPush
from kv_transport.nixl_transport import LATE_WRITE_MARGIN_S, NixlTransport, _PushOut
from kv_transport.notices import PushDoneNotice, PushFailedNotice
from kv_transport.registry import LocalPeerRegistry
from kv_transport.sharded import STILL_POSTED, FetchHeads, checked_reads, read_heads
from tests.kv_transport.pairs import transport_pair
from tests.waiting import CallRecorder, wait_until

LAYOUT = KVLayout(dtype="float32", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)


def _pool(num_blocks: int, fill: float | None = None) -> torch.Tensor:
    shape = (3, 2, num_blocks, 4, 2, 8)
    if fill is None:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return torch.full(shape, fill)


LEASE_S = 30.0  # covers a first handshake and a transfer on a loaded machine: the lease never decides
SHORT_LEASE_S = 2.0  # for the tests of what a lease's end does


def _pair(lease_s: float, consumer_released=lambda rid: None):
    return transport_pair(
        LAYOUT, _pool(8), _pool(6, fill=-1.0), lease_s, consumer_released=consumer_released, peer_check_interval_s=0.0
    )


@pytest.fixture
def pair():
    with _pair(LEASE_S) as transports:
        yield transports


@pytest.fixture
def short_pair():
    with _pair(SHORT_LEASE_S) as transports:
        yield transports


def test_pull_copies_exact_blocks_and_releases_the_producer(pair):
    producer, consumer, src, dst, released, _ = pair
    handle = producer.export("r1", [2, 3, 4, 7], num_tokens=14, first_token=9)
    stats = asyncio.run(consumer.fetch(handle, [0, 1, 2, 5]))
    assert torch.equal(dst[:, :, [0, 1, 2, 5]], src[:, :, [2, 3, 4, 7]])
    assert torch.all(dst[:, :, [3, 4]] == -1)  # untouched
    block_bytes = 4 * 2 * 8 * 4
    assert stats.num_bytes == 3 * 2 * 4 * block_bytes
    assert stats.num_descriptors == 3 * 2 * 2  # runs (2..4 -> 0..2) and (7 -> 5), per layer and K/V
    assert released.event.wait(15) and released.ids == ["r1"]
    assert producer.num_expired_exports == 0  # released by the consumer's notice
    assert not consumer.frees_later("r1")  # the READ ended: nothing lands in its blocks any more


def test_unclaimed_export_is_freed_after_the_timeout(short_pair):
    producer, _, _, _, released, _ = short_pair
    producer.export("lost", [1], num_tokens=2, first_token=1)
    assert released.event.wait(15) and released.ids == ["lost"]
    assert producer.num_expired_exports == 1


def test_dropped_release_notice_falls_back_to_the_timeout():
    registry = LocalPeerRegistry()
    # its lease: the fetch, the first handshake included, ends within it
    producer = NixlTransport("p2", LAYOUT, registry, kv_transfer_timeout_s=5.0)
    consumer = NixlTransport("c2", LAYOUT, registry, faults=FaultPoints.of(drop_release=True))
    released = CallRecorder()
    producer.register_pool(_pool(4), released)
    consumer.register_pool(_pool(4, fill=0.0), lambda rid: None)
    try:
        handle = producer.export("r", [0], 3, 1)
        asyncio.run(consumer.fetch(handle, [1]))
        assert released.event.wait(15) and released.ids == ["r"]
        assert released.times[0] >= handle.expires_at  # no notice: pinned until the lease's end
        assert producer.num_expired_exports == 1
    finally:
        producer.close()
        consumer.close()


def test_layout_mismatch_is_refused(pair):
    producer, consumer, *_ = pair
    handle = producer.export("r", [0], 2, 1)
    other = handle.model_copy(update={"layout": dataclasses.replace(LAYOUT, dtype="bfloat16")})
    with pytest.raises(LayoutMismatchError, match="KV layout mismatch.*request r, peer prod"):
        asyncio.run(consumer.fetch(other, [0]))


def test_restarted_producer_is_rehandshaken_and_old_handles_refused(pair):
    producer, consumer, src, dst, _, registry = pair
    asyncio.run(consumer.fetch(producer.export("a", [0], 2, 1), [0]))
    assert consumer.num_handshakes == 1
    old_handle = producer.export("b", [1], 2, 1)
    producer.close()
    restarted = NixlTransport("prod", LAYOUT, registry)
    src2 = _pool(8) * 2
    restarted.register_pool(src2, lambda rid: None)
    try:
        assert restarted.incarnation != producer.incarnation
        with pytest.raises(StalePeerError, match=f"incarnation {producer.incarnation} is stale"):
            asyncio.run(consumer.fetch(old_handle, [1]))
        asyncio.run(consumer.fetch(restarted.export("c", [3], 2, 1), [2]))
        assert consumer.num_handshakes == 2
        assert torch.equal(dst[:, :, 2], src2[:, :, 3])
    finally:
        restarted.close()


def test_a_closed_producer_s_handles_are_refused_as_stale(pair):
    """A replica's graceful stop closes its transport: the registry entry goes with it."""
    producer, consumer, *_ = pair
    handle = producer.export("gone", [0], 2, 1)
    producer.close()
    with pytest.raises(StalePeerError, match="engine prod is not in the peer registry"):
        asyncio.run(consumer.fetch(handle, [0]))


class _UnreachableRegistry(LocalPeerRegistry):
    """The cluster's key-value store gone first (a shutdown): removing an entry fails."""

    def remove(self, engine_id: str, incarnation: str) -> None:
        raise ConnectionError("GCS unreachable")


def test_close_deregisters_the_pool_even_when_the_registry_is_out_of_reach():
    transport = NixlTransport("lonely", LAYOUT, _UnreachableRegistry())
    transport.register_pool(_pool(2), lambda rid: None)
    with pytest.raises(ConnectionError):
        transport.close()
    assert transport._reg_descs is None


def test_push_writes_layers_and_notifies(pair):
    producer, consumer, src, dst, _, _ = pair

    first_logprobs = TokenLogprobs(42, -0.25, ((42, -0.25), (7, -2.0)))

    async def run():
        dest = consumer.destination("chat:p", [4, 5], num_tokens=6)  # ids may hold the separator
        producer.begin_push(dest)
        for layer in range(3):
            producer.push_layer("chat:p", layer, [6, 7], start_index=0)
        stats = await producer.finish_push("chat:p", first_token=42, first_logprobs=first_logprobs)
        done = await consumer.wait_push(dest)
        return stats, done

    stats, done = asyncio.run(run())
    assert done.first_token == 42 and done.first_logprobs == first_logprobs
    # timed as it is handed to NIXL, so the consumer's thread can only read it later (a time taken
    # after the hand-over could fall after the read)
    assert stats.notice_sent <= done.received_at
    assert torch.equal(dst[:, :, [4, 5]], src[:, :, [6, 7]])
    assert [t.layer for t in stats.layer_times] == [0, 1, 2]
    assert all(t.compute_end <= t.posted <= t.done for t in stats.layer_times)
    assert not consumer.frees_later("chat:p")  # complete: nothing lands in its blocks any more


def test_the_push_s_done_notice_is_timed_after_its_writes(pair):
    """``finish_push`` returns once the done notice has gone, and says when (after every WRITE)."""
    producer, consumer, *_ = pair

    async def run():
        dest = consumer.destination("cb", [4, 5], num_tokens=6)
        producer.begin_push(dest)
        for layer in range(3):
            producer.push_layer("cb", layer, [6, 7], start_index=0)
        stats = await producer.finish_push("cb", first_token=3)
        done = await consumer.wait_push(dest)
        return stats, done

    stats, done = asyncio.run(run())
    assert done.first_token == 3
    assert stats.notice_sent is not None and stats.notice_sent >= max(t.done for t in stats.layer_times)


@pytest.mark.parametrize("fail", [None, 1])
def test_the_done_notice_goes_once_from_the_thread_that_completes_the_last_write(pair, fail):
    """Real futures completed out of order by another thread (as the progress thread does): the
    done notice goes once, from that thread, when the last one ends, and not at all when a
    WRITE failed (``finish_push`` then sends the failure notice)."""
    producer, *_ = pair
    futures = [concurrent.futures.Future() for _ in range(3)]
    push = _PushOut(destination=None, peer="peer", remote_ids=[], futures=futures)
    sent_from: list[tuple[str, str]] = []
    producer._notify = lambda peer, notice: sent_from.append((peer, threading.current_thread().name))
    sent, notified = threading.Lock(), threading.Event()
    producer._notify_when_written(push, PushDoneNotice(request_id="r", first_token=1), sent, notified)

    sent_after: list[int] = []  # notices sent after each completion

    def complete() -> None:
        for i in (2, 0, 1):
            if i == fail:
                futures[i].set_exception(KVTransferError("lost", "r", "peer"))
            else:
                futures[i].set_result(("DONE", time.time()))
            sent_after.append(len(sent_from))

    worker = threading.Thread(target=complete, name="progress")
    worker.start()
    worker.join()
    assert sent_after[:2] == [0, 0]  # nothing before the last
    if fail is None:
        assert sent_from == [("peer", "progress")] and notified.is_set() and push.notice_sent is not None
        assert not sent.acquire(blocking=False)  # taken: finish_push sends nothing more
    else:
        assert sent_from == [] and not notified.is_set() and sent.acquire(blocking=False)


def test_a_push_given_up_by_its_consumer_keeps_the_blocks_until_no_write_can_land():
    """The consumer stops waiting (the request went away) and its producer says nothing: the
    blocks stay reserved until the destination expires, and the producer posts no WRITE
    after that, so none lands in blocks given to another request."""
    freed = CallRecorder()
    with _pair(SHORT_LEASE_S, freed) as (producer, consumer, _, dst, _, _):
        dest = consumer.destination("gone", [0, 1], num_tokens=8)
        producer.begin_push(dest)
        consumer.abort_push("gone")
        assert consumer.frees_later("gone")  # the producer may still write: the transport frees them
        wait_until(time.time, 15, "the destination's expiry", until=lambda now: now > dest.expires_at)
        with pytest.raises(KVTransferTimeout, match="destination expired before this layer .request gone"):
            producer.push_layer("gone", 0, [2, 3], start_index=0)
        assert freed.event.wait(15) and freed.ids == ["gone"]
        assert freed.times[0] >= dest.expires_at + LATE_WRITE_MARGIN_S
        assert torch.all(dst == -1)  # nothing landed


def test_a_write_queued_before_the_destination_expired_is_not_posted_after_it(pair):
    """The progress thread posts a layer's WRITE once its compute is done (on CUDA, later than
    it was queued): past the destination's expiry it fails instead of landing."""
    producer, _, _, dst, _, _ = pair
    dest = pair[1].destination("late-post", [0], num_tokens=4)
    producer.begin_push(dest)
    peer = producer._push_out[dest.request_id].peer
    local, remote = producer._geometry.descs([(2, 1)], [0]), peer.geometry.descs([(0, 1)], [0])
    posted = producer._post("WRITE", local, remote, peer, dest.request_id, deadline=time.time() - 1.0)
    with pytest.raises(KVTransferTimeout, match="destination expired before the post .request late-post"):
        posted.result(15)
    assert torch.all(dst == -1)


def test_a_push_given_up_by_its_consumer_frees_the_blocks_on_the_producer_s_failure_notice():
    """The producer's failure notice comes once none of its WRITEs can land: the blocks the
    consumer had handed to its transport are freed then, not at the destination's expiry."""
    freed = CallRecorder()
    with _pair(LEASE_S, freed) as (producer, consumer, *_):
        dest = consumer.destination("cut", [0, 1], num_tokens=8)
        producer.begin_push(dest)
        producer.push_layer("cut", 0, [2, 3], start_index=0)
        consumer.abort_push("cut")
        assert consumer.frees_later("cut")
        producer.abort_push("cut")  # its prefill failed, or its request went away too
        assert freed.event.wait(15) and freed.ids == ["cut"]
        assert freed.times[0] < dest.expires_at


@pytest.mark.parametrize("fail", [False, True])
def test_a_push_s_failure_notice_goes_once_its_last_write_ended(pair, fail):
    """Real futures completed out of order by another thread (as the progress thread does):
    an aborted push's failure notice goes once, from that thread, when the last WRITE ends
    (DONE or failed), and nothing is posted after the abort."""
    producer, *_ = pair
    futures = [concurrent.futures.Future() for _ in range(3)]
    push = _PushOut(destination=None, peer="peer", remote_ids=[], futures=futures)
    producer._push_out["r"] = push
    sent_from: list[tuple[object, str]] = []
    producer._notify = lambda peer, notice: sent_from.append((notice, threading.current_thread().name))
    producer.abort_push("r")
    assert push.aborted and sent_from == []  # WRITEs under way: no notice yet

    def complete() -> None:
        for i in (2, 0, 1):
            if fail and i == 0:
                futures[i].set_exception(KVTransferError("lost", "r", "peer"))
            else:
                futures[i].set_result(("DONE", time.time()))

    worker = threading.Thread(target=complete, name="progress")
    worker.start()
    worker.join()
    assert sent_from == [(PushFailedNotice(request_id="r"), "progress")]


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_a_push_wait_cancelled_as_the_failure_notice_lands_ends_cancelled(pair, turns):
    """The client went away as its push failed: the cancel and the notice meet (``turns`` loop
    turns apart). The wait ends cancelled, as its request did, never with the push's error
    instead (a request that would then run on, or an error nobody reads)."""
    _, consumer, *_ = pair

    async def run() -> None:
        dest = consumer.destination(f"met-{turns}", [0], 2)
        waiting = asyncio.ensure_future(consumer.wait_push(dest))
        await asyncio.sleep(0)  # waiting for the notice
        consumer._push_in[dest.request_id].set_exception(KVTransferError("the push failed", dest.request_id, "p"))
        for _ in range(turns):
            await asyncio.sleep(0)
        landed = waiting.cancel()  # False: the wait had ended with the notice (the push's error)
        with pytest.raises(asyncio.CancelledError if landed else KVTransferError):
            await waiting
        assert landed or turns > 0

    asyncio.run(run())


def test_push_wait_times_out_with_a_typed_error(short_pair):
    _, consumer, *_ = short_pair
    dest = consumer.destination("never", [0], 2)
    with pytest.raises(KVTransferTimeout, match="no push completion within 2.0 s .request never"):
        asyncio.run(consumer.wait_push(dest))


def test_a_cancelled_head_wise_push_fails_the_consumer_only_once_its_writes_ended(pair):
    """The client went away while a push written head by head (another tensor-parallel split)
    was finishing: the failure notice, on which the consumer frees its blocks, waits for the
    WRITEs already under way, so none can land in blocks given to another request."""
    producer, consumer, src, dst, _, _ = pair
    me = (RankPeer(engine_id=producer.engine_id, incarnation=producer.incarnation, kv_head_start=0, num_kv_heads=2),)

    async def run() -> list[int]:
        dest = consumer.destination("cut", [4, 5], num_tokens=6)
        push, gate, wrote = HeadPush(dest), asyncio.Event(), []
        push.record([6, 7], 0)

        async def write(block_ids: list[int]) -> list[int]:
            await gate.wait()
            wrote.append((await asyncio.to_thread(producer.push_heads, dest, block_ids, range(2), 0, me))[0])
            return wrote

        finishing = asyncio.ensure_future(producer.finish_heads(push, 9, None, write))
        waiting = asyncio.ensure_future(consumer.wait_push(dest))
        for _ in range(3):
            await asyncio.sleep(0)
        finishing.cancel()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not finishing.done() and not waiting.done()  # the writes are held: no notice yet
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        with pytest.raises(KVTransferError, match="the producer's push failed"):
            await waiting
        return wrote

    assert asyncio.run(run()) == [3 * 2 * 2 * 4 * 2 * 8 * 4]  # layers x K/V x blocks x tokens x heads x dim x 4 B
    assert torch.equal(dst[:, :, [4, 5]], src[:, :, [6, 7]])


def _head_wise(handle):
    """The handle as a producer split over KV heads would give it (its one rank named)."""
    return handle.model_copy(update={"ranks": (RankPeer.whole(handle),)})


def _gated_head_wise_pull(consumer: NixlTransport, handle, blocks: list[int]):
    """Start a head-wise pull of ``handle``: the READ thread waits at ``gate`` before it reads;
    cancelled once the thread is inside: ``(loop, gate)``; the test ends the loop."""
    handle = _head_wise(handle)
    gate, inside, real = threading.Event(), threading.Event(), consumer.fetch_heads

    def gated(*args):
        # the transport's own threads: a hung peer cannot starve the replica's default pool
        assert threading.current_thread().name.startswith(f"kv-heads-{consumer.engine_id}")
        inside.set()
        assert gate.wait(15)
        return real(*args)

    consumer.fetch_heads = gated

    async def cancelled() -> None:
        task = asyncio.ensure_future(consumer.fetch(handle, blocks))
        assert await asyncio.to_thread(inside.wait, 15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop = asyncio.new_event_loop()
    loop.run_until_complete(cancelled())
    return loop, gate


def test_a_cancelled_head_wise_pull_keeps_the_blocks_until_its_reads_end():
    """A pull from a producer split over other KV heads READs on a thread that cancelling the
    pull does not stop: its blocks are freed once that thread's READs have landed, not at the cancel."""
    freed = CallRecorder()
    with _pair(LEASE_S, freed) as (producer, consumer, src, dst, _, _):
        handle = producer.export("split", [2, 3], num_tokens=8, first_token=1)
        loop, gate = _gated_head_wise_pull(consumer, handle, [0, 1])
        try:
            assert consumer.frees_later("split")  # the thread still reads into blocks 0 and 1
            assert not freed.event.wait(0.5)  # the progress thread's rounds free nothing meanwhile
            gate.set()
            assert freed.event.wait(15) and freed.ids == ["split"]
            assert torch.equal(dst[:, :, [0, 1]], src[:, :, [2, 3]])  # landed before the free
        finally:
            gate.set()
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()


def test_a_head_wise_pull_whose_read_timed_out_keeps_the_blocks_for_a_timeout():
    """A READ posted whose wait timed out may still land: the blocks are freed
    ``kv_transfer_timeout_s`` after the pull ended, not at once (nor at the lease's bound)."""
    freed = CallRecorder()
    with _pair(SHORT_LEASE_S, freed) as (producer, consumer, *_):
        handle = _head_wise(producer.export("stuck", [2], num_tokens=4, first_token=1))
        consumer._worker.read_inline = lambda *args: concurrent.futures.Future()  # posted, never completes
        with pytest.raises(KVTransferTimeout, match="NIXL READ not complete .* .request stuck"):
            asyncio.run(consumer.fetch(handle, [0]))
        after = time.time()
        assert consumer.frees_later("stuck")
        assert consumer._freeing["stuck"] <= after + SHORT_LEASE_S
        assert freed.event.wait(15) and freed.ids == ["stuck"]


def test_a_head_wise_pull_that_failed_before_reading_frees_the_blocks_at_once(pair):
    """No READ was posted (its producer restarted): nothing can land, nothing is held."""
    producer, consumer, *_ = pair
    handle = producer.export("stale", [2], num_tokens=4, first_token=1)
    with pytest.raises(StalePeerError):
        asyncio.run(consumer.fetch(_head_wise(handle.model_copy(update={"incarnation": "gone"})), [0]))
    assert not consumer.frees_later("stale")


def test_a_head_wise_pull_dropped_before_its_thread_started_never_reads():
    """Cancelled while its READ waited for a thread: the READ never runs, and the blocks are
    not held for it."""
    with _pair(LEASE_S) as (producer, consumer, *_):
        handle = producer.export("early", [2], num_tokens=4, first_token=1)
        read = consumer.reading(handle, lambda: pytest.fail("a dropped READ ran"))
        read.drop()
        assert not consumer.frees_later("early")  # freed at once by the engine link
        with pytest.raises(KVTransferError, match="cancelled before its READ started .request early"):
            read()


@pytest.mark.parametrize("how", ["a rank answered -1", "raised"])
def test_a_head_wise_push_whose_writes_failed_keeps_the_blocks_until_no_write_can_land(how):
    """A rank's WRITE failed (its wait timed out: it may still land), as a tensor-parallel rank
    answers it or as one rank's ``push_heads`` raises it: the consumer stops waiting at the
    producer's failure notice, but frees the blocks only after the destination's expiry and
    margin, as when the producer says nothing."""
    freed = CallRecorder()
    with _pair(SHORT_LEASE_S, freed) as (producer, consumer, *_):
        dest = consumer.destination("torn", [0, 1], num_tokens=8)
        push = HeadPush(dest)
        push.record([2, 3], 0)

        async def write(block_ids: list[int]) -> list[int]:
            if how == "raised":
                raise KVTransferTimeout("NIXL WRITE not complete after 2.0 s", "torn", "cons")
            return [-1]

        async def run() -> None:
            waiting = asyncio.ensure_future(consumer.wait_push(dest))
            with pytest.raises(KVTransferError, match=r"ranks \[0\] could not write|WRITE not complete"):
                await producer.finish_heads(push, 9, None, write)
            with pytest.raises(KVTransferError, match="the producer's push failed"):
                await waiting

        asyncio.run(run())
        consumer.abort_push("torn")  # as the consumer's engine link drops it
        assert consumer.frees_later("torn")
        assert freed.event.wait(15) and freed.ids == ["torn"]
        assert freed.times[0] >= dest.expires_at + LATE_WRITE_MARGIN_S


def test_a_head_wise_push_cancelled_twice_ends_cancelled_and_says_a_write_may_land(pair):
    """Cancelled again while it waits for its WRITEs to end: the caller still gets its cancel,
    and the consumer hears that a WRITE may still land (it keeps the blocks until its bound)."""
    producer, consumer, *_ = pair

    async def run() -> None:
        dest = consumer.destination("twice", [4, 5], num_tokens=6)
        push, gate = HeadPush(dest), asyncio.Event()
        push.record([6, 7], 0)

        async def write(block_ids: list[int]) -> list[int]:
            await gate.wait()
            return [1]

        finishing = asyncio.ensure_future(producer.finish_heads(push, 9, None, write))
        waiting = asyncio.ensure_future(consumer.wait_push(dest))
        for _ in range(2):  # the first cancel: it waits for write; the second: it stops waiting
            for _ in range(3):
                await asyncio.sleep(0)
            finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        with pytest.raises(KVTransferError, match="the producer's push failed"):
            await waiting
        consumer.abort_push("twice")
        assert consumer.frees_later("twice")  # a W notice: no early free
        gate.set()

    asyncio.run(run())


def test_a_tensor_parallel_rank_says_when_its_read_may_still_land():
    """A rank's answer to rank 0's read command tells a READ still posted (its wait timed out)
    from a failure with nothing in flight, so rank 0's transport holds the blocks only then."""
    with _pair(SHORT_LEASE_S) as (producer, consumer, *_):
        handle = producer.export("ranked", [2], num_tokens=4, first_token=1)
        stale = FetchHeads(handle.model_copy(update={"incarnation": "gone"}), (0,), 0)
        with pytest.raises(StalePeerError):  # the rank's worker answers -1 for it
            read_heads(consumer, stale, range(2), rank=1)
        consumer._worker.read_inline = lambda *args: concurrent.futures.Future()  # posted, never completes
        assert read_heads(consumer, FetchHeads(handle, (0,), 0), range(2), rank=1) == STILL_POSTED
    assert checked_reads([64, 64], "r") == [64, 64]
    with pytest.raises(ReadStillPosted, match=r"ranks \[1\] could not read their KV \(a READ may still land\)"):
        checked_reads([64, STILL_POSTED], "r")
    with pytest.raises(KVTransferError, match=r"ranks \[0\] could not read") as failed:
        checked_reads([-1, 64], "r")
    assert not isinstance(failed.value, ReadStillPosted)


def test_a_read_queued_behind_the_progress_thread_is_not_posted_after_the_lease(pair):
    """A READ the calling thread could not post (the progress thread held the agent) waits in
    its queue: past the handle's lease it fails instead of landing in blocks that its caller,
    whose wait timed out, no longer holds."""
    producer, consumer, _, dst, _, _ = pair
    producer.export("queued", [2], num_tokens=4, first_token=1)
    peer = consumer._peer(producer.engine_id, producer.incarnation, "queued")
    local, remote = consumer._geometry.descs([(0, 1)]), peer.geometry.descs([(2, 1)])
    holding, release = threading.Event(), threading.Event()

    def hold_the_agent() -> None:  # as the progress thread does while it posts
        with consumer._worker.lock:
            holding.set()
            release.wait(15)

    holder = threading.Thread(target=hold_the_agent)
    holder.start()
    assert holding.wait(15)
    try:
        done = consumer._worker.read_inline(
            local, remote, peer.agent_name, producer.engine_id, peer.info.mem_type, "queued", time.time() - 1.0
        )
    finally:
        release.set()
        holder.join()
    assert isinstance(done, concurrent.futures.Future)  # queued for the progress thread
    with pytest.raises(KVTransferTimeout, match="its lease expired before the post .request queued"):
        done.result(15)
    assert torch.all(dst[:, :, 0] == -1)
