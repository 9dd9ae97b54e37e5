"""KV transport over NIXL (UCX backend): CPU memory here, GPU memory with the same code.

One NIXL agent per engine process; the whole pool is registered once. Peers are
handshaken on first contact from the registry's metadata and cached per (engine id,
incarnation), so a restarted peer is re-handshaken and never reused stale.

Layer pushes, polling and completion run on the progress thread of
``nixl_worker.NixlWorker`` and a pull's READ is posted by its caller (see there why); all
agent calls hold its lock. Notices (``kv_transport.notices``: release, push complete, push
failed) always go between the two processes' notice agents, never attached to a transfer
(see ``NixlWorker``); a push's completion notice goes from the progress thread the moment it
sees the push's last WRITE complete.

With ``staging="host"`` NIXL sees a host buffer instead of the pool (``kv_transport.staging``
says who copies what); every method keeps its contract. On CUDA a pushed layer's WRITE waits
for an event recorded after the layer's compute (``event_type``, ``torch.cuda.Event`` by
default; tests inject a fake): the progress thread posts it once that event has completed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Generic, TypeVar

import torch

from engine.kv_pool import KVLayout
from engine.params import TokenLogprobs
from kv_transport import notices
from kv_transport import staging as staging_mod
from kv_transport.base import (
    BaseKVTransport,
    KVTransferError,
    KVTransferTimeout,
    LayerTiming,
    LayoutMismatchError,
    PushCompletion,
    ReadStillPosted,
    ReleaseBlocks,
    StalePeerError,
    TransferStats,
)
from kv_transport.config import DEFAULT_STAGING_BYTES, check_staging
from kv_transport.descriptors import Descs, PoolGeometry, coalesce, id_ranges, pair_ranges
from kv_transport.faults import NO_FAULTS, FaultPoints
from kv_transport.handle import KVDestination, KVHandle, RankPeer, to_ranges
from kv_transport.heads import HeadPush, PoolInfo, head_sources, head_targets, rows
from kv_transport.nixl_worker import WAIT_POLL_S, LayerEvent, NixlWorker, Post, PostedAt
from kv_transport.registry import BasePeerRegistry, PeerInfo

logger = logging.getLogger(__name__)

PEER_CHECK_INTERVAL_S = 5.0  # a cached peer is re-confirmed in the registry at most this often
NOTICE_SEND_WAIT_S = 1.0  # bounds finish_push's wait for a notice another thread is sending
# a push's blocks are reused this long after its destination expires: a producer posts no WRITE
# after the expiry, and one posted just before has landed by then
LATE_WRITE_MARGIN_S = 1.0
HEAD_THREADS = 16  # head-wise transfers of one transport at once (one thread each)

T = TypeVar("T")


@dataclass
class _Peer:
    info: PeerInfo
    agent_name: str
    notice_agent: str  # where notices go (see NixlWorker)
    checked_at: float  # monotonic time of the last registry confirmation
    geometry: PoolGeometry  # where its blocks are


@dataclass(frozen=True)
class _LayerPush:
    layer: int
    compute_end: float  # unix time
    posted_at: PostedAt  # filled by the progress thread


@dataclass
class _PushOut:
    destination: KVDestination
    peer: _Peer
    remote_ids: list[int]
    layers: list[_LayerPush] = field(default_factory=list)
    futures: list[concurrent.futures.Future] = field(default_factory=list)
    num_bytes: int = 0
    num_descriptors: int = 0
    slots: list[int] = field(default_factory=list)  # staging: one per destination block after skip_blocks
    notice_sent: float | None = None  # unix s
    aborted: bool = False  # no WRITE is posted once set (under ``lock``: the engine thread posts)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _StagedIn:
    """A staging consumer's push: the slots written by the producer and the pool blocks they go to."""

    slots: list[int]
    block_ids: list[int]


def _check_lease(handle: KVHandle, when: str) -> None:
    """A handle whose lease ran out names blocks the producer has freed (and may have reused):
    reading them could answer with another request's KV, so the fetch fails instead."""
    if handle.seconds_left() <= 0:
        raise KVTransferTimeout(f"the KV lease expired {when}", handle.request_id, handle.engine_id)


class NixlTransport(BaseKVTransport):
    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        registry: BasePeerRegistry,
        kv_transfer_timeout_s: float = 60.0,
        faults: FaultPoints = NO_FAULTS,
        peer_check_interval_s: float = PEER_CHECK_INTERVAL_S,
        staging: str = "none",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        event_type: Callable[[], LayerEvent] | None = None,
        notice_poll_s: float = WAIT_POLL_S,
    ) -> None:
        """``staging``: ``"none"`` or ``"host"`` (``transport.staging``), with a buffer of
        ``staging_bytes``; ``event_type``: what marks a pushed layer's compute as done
        (default: ``torch.cuda.Event`` for a CUDA pool, none for a CPU pool, whose compute is
        done when ``push_layer`` is called); ``notice_poll_s``: see ``NixlWorker``."""
        self.staging_kind = check_staging(staging)
        self.staging_bytes = staging_bytes
        self.staging: staging_mod.HostStaging | None = None  # made with the pool
        self._event_type = event_type
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.layout = layout
        self.timeout_s = kv_transfer_timeout_s
        self.faults = faults
        self.peer_check_interval_s = peer_check_interval_s
        self._registry = registry
        self._worker = NixlWorker(f"{engine_id}.{self.incarnation}", notice_poll_s=notice_poll_s)
        self._agent = self._worker.agent
        self._lock = self._worker.lock
        self._peer_lock = threading.Lock()
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._exports: dict[str, float] = {}  # request id -> expiry (unix time)
        self._push_out: dict[str, _PushOut] = {}
        self._head_push: dict[str, HeadPush] = {}  # to a consumer that splits the KV heads otherwise
        self._push_in: dict[str, concurrent.futures.Future] = {}
        self._export_slots: dict[str, list[int]] = {}  # staging producer, pull: request id -> slots
        self._staged_in: dict[str, _StagedIn] = {}  # staging consumer, push
        self._slots_later: list[tuple[float, list[int]]] = []  # (unix time, slots) freed then
        # consumer, pool blocks a transfer may still write into: request id -> unix time none can
        # (open pushes, and READs that ended unfinished still posted); then the handed over ones
        self._landing: dict[str, float] = {}
        self._freeing: dict[str, float] = {}  # freed (``release_blocks``) at that time
        self._held_lock = threading.Lock()  # the two change together on several threads
        # head-wise transfers block a thread each, up to a timeout when a peer hangs: their own
        # threads, so they cannot starve the replica's other ones (asyncio's default pool)
        self._head_threads = concurrent.futures.ThreadPoolExecutor(HEAD_THREADS, f"kv-heads-{engine_id}")
        self._release_blocks: ReleaseBlocks | None = None
        self._pool: torch.Tensor | None = None
        self._reg_descs = None
        self.num_handshakes = 0
        self.num_expired_exports = 0
        self._closed = False

    # ---- setup ------------------------------------------------------------------------

    def register_pool(self, pool: torch.Tensor, release_blocks: ReleaseBlocks) -> None:
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        self._pool = pool
        self._block_bytes = pool[0, 0, 0].numel() * pool.element_size()
        if self._event_type is None and pool.is_cuda:
            self._event_type = torch.cuda.Event
        if self.staging_kind == "host":
            self.staging = staging_mod.HostStaging(pool, self.layout.num_layers, self.staging_bytes)
        # what NIXL registers and peers address: the pool, or the staging buffer in its place
        exposed = pool if self.staging is None else self.staging.buffer
        self._num_blocks = exposed.shape[2]
        self._mem_type = "VRAM" if exposed.is_cuda else "DRAM"
        self._device_id = exposed.get_device() if exposed.is_cuda else 0
        self._release_blocks = release_blocks
        self._geometry = PoolGeometry(
            exposed.data_ptr(), self.layout.num_layers, self._num_blocks, self._block_bytes, self._device_id
        )
        self._worker.local_mem_type = self._mem_type
        self._worker.cuda_device = pool.get_device() if pool.is_cuda else None
        self._worker.bind_cuda()  # this thread registers the pool and may handshake
        self._reg_descs = self._agent.register_memory(exposed)
        self._registry.publish(
            PeerInfo(
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                agent_name=self._agent.name,
                agent_metadata=self._agent.get_agent_metadata(),
                notice_agent_metadata=self._worker.notices.get_agent_metadata(),
                layout=self.layout,
                pool_address=exposed.data_ptr(),
                num_blocks=self._num_blocks,
                device_id=self._device_id,
                mem_type=self._mem_type,
            )
        )
        self._worker.start(self._on_notif, self._expire_exports, lambda: bool(self._push_in or self._exports))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._head_threads.shutdown(wait=False, cancel_futures=True)
        self._worker.stop()
        try:
            self._registry.remove(self.engine_id, self.incarnation)
        finally:  # the registry may be gone with the cluster
            with self._lock:
                if self._reg_descs is not None:
                    self._agent.deregister_memory(self._reg_descs)
                    self._reg_descs = None

    def stay_awake(self) -> None:
        """Never poll at the slow idle pace: for a tensor-parallel rank's agent, which serves
        reads of its heads without an export of its own to wake it (over TCP, UCX answers a
        READ only in the target's progress calls)."""
        self._worker.idle_backoff_after_s = None

    # ---- pull -------------------------------------------------------------------------

    def export(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int) -> KVHandle:
        if self.faults:
            self.faults.hit("export", request_id, self.engine_id)
        expires_at = time.time() + self.timeout_s
        if self.staging is None:
            self._exports[request_id] = expires_at
            self._worker.expect()
            return KVHandle.of_blocks(self, request_id, block_ids, num_tokens, expires_at, first_token=first_token)
        slots = self._stage_export(request_id, block_ids)
        self._exports[request_id] = expires_at
        self._worker.expect()
        return staging_mod.StagedHandle.of_blocks(
            self, request_id, block_ids, num_tokens, expires_at, first_token=first_token, staged_ranges=to_ranges(slots)
        )

    def _stage_export(self, request_id: str, block_ids: list[int]) -> list[int]:
        """Staging producer, pull: copy the blocks into slots and wait for that copy alone (a
        consumer may READ as soon as it holds the handle); the slots, kept until release."""
        slots = self.staging.slots.allocate(len(block_ids), request_id, self.engine_id)
        try:
            staging_mod.wait_copied_now(self.staging.to_host(block_ids, slots))
        except BaseException:
            self.staging.slots.free(slots)
            raise
        self._export_slots[request_id] = slots
        return slots

    async def fetch(self, handle: KVHandle, local_block_ids: list[int], skip_blocks: int = 0) -> TransferStats:
        if handle.split_otherwise(self.layout):
            return await self._fetch_resharded(handle, local_block_ids, skip_blocks)
        # the copy runs in this thread once posted: every step before the post adds to the pull
        rid, peer_id = handle.request_id, handle.engine_id
        peer = self._peer(peer_id, handle.incarnation, rid)
        self._check_layout(handle.layout, rid, peer_id)
        if self.faults:
            await self.faults.hit_async("fetch", rid, peer_id)
        _check_lease(handle, "before the READ")
        slots = None  # staging: the READ lands in these, then they are copied into the pool
        if self.staging is not None:
            slots = self.staging.slots.allocate(len(local_block_ids) - skip_blocks, rid, peer_id)
        targets = local_block_ids[skip_blocks:] if slots is None else slots
        try:
            runs, num_descriptors, start = await self._read(handle, peer, targets, skip_blocks)
        except BaseException:
            if slots is not None:  # a READ that timed out may still land in them (not in the pool)
                self._landing.pop(rid, None)
                self._free_slots_later(slots)
            raise
        if slots is not None:
            await self._copy_in(rid, _StagedIn(slots, local_block_ids[skip_blocks:]))
        seconds = time.perf_counter() - start
        # The release notice goes on its own, not attached to the READ: NIXL sends an attached
        # notice only once the READ is done, and between CPU memories the READ then stays in
        # flight until the producer's next progress call, a large share of a pull. The progress
        # thread sends it (the KV is here already), so sending costs the pull nothing
        # (figures: docs/benchmarks/kv_transfer_probes.md).
        if not (self.faults and self.faults.drops("release", rid)):
            self._worker.notify_soon(peer.notice_agent, notices.encode(notices.ReleaseNotice(request_id=rid)))
        num_bytes = sum(n for _, _, n in runs) * self._block_bytes * len(self._geometry.bases)
        return TransferStats(num_bytes=num_bytes, seconds=seconds, num_descriptors=num_descriptors)

    async def _read(
        self, handle: KVHandle, peer: _Peer, targets: list[int], skip_blocks: int
    ) -> tuple[list[tuple[int, int, int]], int, float]:
        """READ the handle's blocks after ``skip_blocks`` into ``targets`` (pool blocks or staging
        slots, one per block): the runs, the descriptor count and when the READ was posted."""
        rid, peer_id = handle.request_id, handle.engine_id
        runs = _pull_runs(handle, targets, skip_blocks)
        remote = peer.geometry.descs([(s, n) for s, _, n in runs])
        local = self._geometry.descs([(d, n) for _, d, n in runs])
        start = time.perf_counter()
        if runs:  # none: every block was in this replica's prefix cache
            done = self._worker.read_inline(
                local, remote, peer.agent_name, peer_id, peer.info.mem_type, rid, handle.expires_at
            )
            if not isinstance(done, tuple):  # still in flight: the progress thread completes it
                timeout = max(0.0, min(self.timeout_s, handle.seconds_left()))
                try:
                    await self._await_xfer(done, timeout, rid, peer_id, "READ")
                except BaseException:
                    if not done.done():  # it may still land in ``targets``: until it ends, or the timeout
                        self._hold(rid)
                        done.add_done_callback(lambda _: self._quiet(rid))
                    raise
            _check_lease(handle, "during the READ")  # the producer may have reused the blocks
        return runs, len(local), start

    async def _fetch_resharded(self, handle: KVHandle, local_block_ids: list[int], skip_blocks: int) -> TransferStats:
        """A pull from a producer of another tensor-parallel degree (this engine has one rank)."""
        start = time.perf_counter()
        heads = range(self.layout.num_kv_heads)
        read = self.reading(
            handle, lambda: self.fetch_heads(handle, local_block_ids, skip_blocks, heads), says_in_flight=True
        )
        try:
            num_bytes, num_rows = await self._on_head_thread(read)
        except BaseException:  # cancelled (the thread READs on, unless it had not started), or closed
            read.drop()
            raise
        self.give_back(handle)
        return TransferStats(num_bytes=num_bytes, seconds=time.perf_counter() - start, num_descriptors=num_rows)

    def fetch_heads(
        self, handle: KVHandle, local_block_ids: list[int], skip_blocks: int, heads: range, rank: int = 0
    ) -> tuple[int, int]:
        """Blocking: READ the model's KV heads ``heads`` (this pool's, in order) of the handle's
        blocks after ``skip_blocks`` from the producer ranks that hold them (``kv_transport.heads.head_sources``;
        ``rank`` spreads replicated heads over their holders), sends no notice; (bytes, rows)."""
        rid = handle.request_id
        self._check_unstaged(handle)
        src_blocks, dst_blocks = handle.block_ids[skip_blocks:], local_block_ids[skip_blocks:]
        num_bytes = num_rows = 0
        for source, first, count in head_sources(handle, heads, self.layout, rank):
            peer = self._peer(source.engine_id, source.incarnation, rid)
            theirs, ours = peer.info.layout, self.layout
            whole = count == theirs.num_kv_heads == ours.num_kv_heads
            remote = rows(peer.info, src_blocks, None if whole else first - source.kv_head_start, count)
            local = rows(self._own_info(), dst_blocks, None if whole else first - heads.start, count)
            if not len(local):
                continue
            _check_lease(handle, "before the READ")  # a handshake may have taken a while
            done = self._worker.read_inline(
                local, remote, peer.agent_name, source.engine_id, peer.info.mem_type, rid, handle.expires_at
            )
            if not isinstance(done, tuple):
                try:
                    _wait_done(done, max(0.0, min(self.timeout_s, handle.seconds_left())), rid, source.engine_id)
                except KVTransferTimeout as exc:
                    raise ReadStillPosted(exc.message, rid, source.engine_id) from None
            num_bytes, num_rows = num_bytes + int(local[:, 1].sum()), num_rows + len(local)
        _check_lease(handle, "during the READ")
        return num_bytes, num_rows

    def reading(self, handle: KVHandle, read: Callable[[], T], says_in_flight: bool = False) -> _Reading[T]:
        """``read``, a blocking head-wise READ into the handle's local blocks to run on another
        thread, with those blocks held while it may still write into them: from now (its caller
        may be cancelled while the thread goes on) until it ends, or, ended unfinished (a READ
        whose wait timed out may still land), ``kv_transfer_timeout_s`` later. A bound covers a
        thread that never ends: the lease, then one more timeout. ``says_in_flight``: ``read``
        leaves a READ in flight only when it raises ``ReadStillPosted`` (as ``fetch_heads``: it
        waits for each READ before the next), so its other ``KVTransferError``s free the blocks at once."""
        self._landing[handle.request_id] = handle.expires_at + self.timeout_s + LATE_WRITE_MARGIN_S
        return _Reading(self, handle.request_id, read, says_in_flight)

    async def _on_head_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._head_threads, fn)

    def _own_info(self) -> PoolInfo:
        return PoolInfo(self.layout, self._geometry.bases[0], self._num_blocks, self._device_id)

    def give_back(self, handle: KVHandle) -> None:
        rid = handle.request_id
        if self.faults and self.faults.drops("release", rid):
            return
        try:
            peer = self._peer(handle.engine_id, handle.incarnation, rid)
        except KVTransferError:  # stopped or restarted: its blocks went with it
            return
        self._worker.notify_soon(peer.notice_agent, notices.encode(notices.ReleaseNotice(request_id=rid)))

    def release(self, request_id: str) -> None:
        self._release(request_id)

    def _release(self, request_id: str, expired: bool = False) -> None:
        if self._exports.pop(request_id, None) is None:
            return
        if expired:  # counted before the blocks go back: a report showing them free counts it
            logger.warning("KV of request %s unclaimed after %.1f s: freeing its blocks", request_id, self.timeout_s)
            self.num_expired_exports += 1
        slots = self._export_slots.pop(request_id, None)
        if slots:
            self.staging.slots.free(slots)
        if self._release_blocks is not None:
            self._release_blocks(request_id)

    # ---- push -------------------------------------------------------------------------

    def destination(
        self, request_id: str, block_ids: list[int], num_tokens: int, skip_blocks: int = 0
    ) -> KVDestination:
        expires_at = time.time() + self.timeout_s
        if self.staging is None:
            self._landing[request_id] = expires_at + LATE_WRITE_MARGIN_S
            self._push_in[request_id] = concurrent.futures.Future()
            self._worker.expect()
            return KVDestination.of_blocks(self, request_id, block_ids, num_tokens, expires_at, skip_blocks=skip_blocks)
        slots = self.staging.slots.allocate(len(block_ids) - skip_blocks, request_id, self.engine_id)
        self._staged_in[request_id] = _StagedIn(slots, list(block_ids[skip_blocks:]))
        self._push_in[request_id] = concurrent.futures.Future()
        self._worker.expect()
        return staging_mod.StagedDestination.of_blocks(
            self,
            request_id,
            block_ids,
            num_tokens,
            expires_at,
            skip_blocks=skip_blocks,
            staged_ranges=to_ranges(slots),
        )

    def begin_push(self, destination: KVDestination) -> None:
        rid = destination.request_id
        peer = self._peer(destination.engine_id, destination.incarnation, rid)
        if destination.split_otherwise(self.layout):
            self._head_push[rid] = HeadPush(destination)  # written head by head by finish_push
            return
        self._check_layout(destination.layout, rid, destination.engine_id)
        slots = []
        if self.staging is not None:
            num_written = len(destination.block_ids) - destination.skip_blocks
            slots = self.staging.slots.allocate(num_written, rid, destination.engine_id)
        self._push_out[rid] = _PushOut(destination, peer, staging_mod.remote_block_ids(destination), slots=slots)

    def push_layer(self, request_id: str, layer: int, local_block_ids: Sequence[int], start_index: int) -> None:
        push = self._push_out.get(request_id)
        if push is None:
            head_push = self._head_push.get(request_id)
            if head_push is not None:
                head_push.record(local_block_ids, start_index)
            return
        skip = push.destination.skip_blocks - start_index  # blocks the consumer holds already
        if skip > 0:
            local_block_ids, start_index = local_block_ids[skip:], start_index + skip
            if not local_block_ids:
                return
        compute_end, consumer, expiry = time.time(), push.destination.engine_id, push.destination.expires_at
        if compute_end >= expiry:  # its consumer may reuse the blocks from now on (nor is one posted after it)
            raise KVTransferTimeout("the push's destination expired before this layer", request_id, consumer)
        if self.faults:
            self.faults.hit("push_layer", request_id, consumer, layer)
        remote_ids = push.remote_ids[start_index : start_index + len(local_block_ids)]
        source_ids, event = self._layer_source(push, layer, local_block_ids, start_index)
        runs = coalesce(source_ids, remote_ids)
        local = self._geometry.descs([(s, n) for s, _, n in runs], [layer])
        remote = push.peer.geometry.descs([(d, n) for _, d, n in runs], [layer])
        record = _LayerPush(layer=layer, compute_end=compute_end, posted_at=PostedAt())
        push.layers.append(record)
        push.num_bytes += sum(length for _, length, _ in local)
        push.num_descriptors += len(local)
        with push.lock:
            if not push.aborted:
                posted = self._post("WRITE", local, remote, push.peer, request_id, record.posted_at, event, expiry)
                push.futures.append(posted)

    def _layer_source(
        self, push: _PushOut, layer: int, block_ids: Sequence[int], start_index: int
    ) -> tuple[Sequence[int], LayerEvent | None]:
        """What one layer's WRITE reads (the pool's blocks, or their staging slots) and the event
        its post waits for: the layer's compute event (recorded now, on the current stream), or
        the staging copy's, which the side stream queues after it. Nothing waits here."""
        compute = None
        if self._event_type is not None:
            compute = self._event_type()
            compute.record()
        if self.staging is None:
            return block_ids, compute
        first = start_index - push.destination.skip_blocks
        slots = push.slots[first : first + len(block_ids)]
        copied = self.staging.to_host(block_ids, slots, [layer], after=compute)
        return slots, compute if copied is None else copied

    async def finish_push(
        self, request_id: str, first_token: int, first_logprobs: TokenLogprobs | None = None
    ) -> TransferStats:
        head_push = self._head_push.pop(request_id, None)
        if head_push is not None:
            me = (RankPeer.whole(self),)
            heads = range(self.layout.num_kv_heads)

            async def write(block_ids: list[int]) -> list[int]:
                num_bytes, _ = await self._on_head_thread(
                    lambda: self.push_heads(head_push.destination, block_ids, heads, 0, me)
                )
                return [num_bytes]

            return await self.finish_heads(head_push, first_token, first_logprobs, write)
        push = self._push_out.pop(request_id)
        try:
            return await self._complete_push(push, request_id, first_token, first_logprobs)
        finally:
            self._free_slots(push.slots)  # every WRITE from them is done (or the push failed)

    async def _complete_push(
        self, push: _PushOut, request_id: str, first_token: int, first_logprobs: TokenLogprobs | None
    ) -> TransferStats:
        """Await the push's WRITEs; the done notice goes as soon as the last is seen complete,
        from the thread that sees it (``_notify_when_written``), the failure notice if one fails."""
        peer_id = push.destination.engine_id
        sent = threading.Lock()  # taken by whoever sends this push's notice, done or failed
        notified = threading.Event()  # the done notice went from a WRITE's callback
        try:
            if self.faults:
                await self.faults.hit_async("finish_push", request_id, peer_id)
            done_notice = notices.PushDoneNotice(
                request_id=request_id, first_token=first_token, first_logprobs=first_logprobs
            )
            self._notify_when_written(push, done_notice, sent, notified)
            timeout = max(0.0, min(self.timeout_s, push.destination.seconds_left()))
            done = [await self._await_xfer(f, timeout, request_id, peer_id, "WRITE") for f in push.futures]
        except BaseException:
            if sent.acquire(blocking=False):
                self._fail_when_ended(push, request_id)
            raise
        if sent.acquire(blocking=False):  # no WRITE left to complete (none was posted)
            self._send_done(push, done_notice)
        else:  # the last WRITE's callback is sending it (microseconds): returned, it has gone
            notified.wait(NOTICE_SEND_WAIT_S)
        layer_times = tuple(
            LayerTiming(layer=r.layer, compute_end=r.compute_end, posted=r.posted_at.unix_s, done=d)
            for r, d in zip(push.layers, done)
        )
        first = layer_times[0].compute_end if layer_times else time.time()
        last = max((t.done for t in layer_times), default=first)
        return TransferStats(
            num_bytes=push.num_bytes,
            seconds=last - first,
            num_descriptors=push.num_descriptors,
            layer_times=layer_times,
            notice_sent=push.notice_sent,
        )

    def _notify_when_written(
        self, push: _PushOut, notice: notices.PushDoneNotice, sent: threading.Lock, notified: threading.Event
    ) -> None:
        """Send ``notice`` from the callback of the push's last WRITE to complete, if every one
        ended DONE: the progress thread sends it the moment it sees that, with no trip through
        the event loop (docs/benchmarks/gpu.md, push tail). ``sent`` makes it the only notice;
        ``notified`` is set once it went."""
        futures = list(push.futures)

        def written(_: concurrent.futures.Future) -> None:
            # layers complete in order: an early callback stops at the next layer's future
            if all(f.done() for f in futures) and all(_wrote(f) for f in futures) and sent.acquire(blocking=False):
                try:
                    self._send_done(push, notice)
                finally:
                    notified.set()

        for future in futures:
            future.add_done_callback(written)

    def _fail_when_ended(self, push: _PushOut, request_id: str) -> None:
        """Producer: post no more of the push's WRITEs, and send its failure notice once none
        can still land (the consumer frees the blocks on it): now, or from the callback of the
        last one to end."""
        with push.lock:
            push.aborted = True
            futures = list(push.futures)
        once = threading.Lock()

        def ended(_: concurrent.futures.Future | None = None) -> None:
            if all(f.done() for f in futures) and once.acquire(blocking=False):
                self._notify(push.peer, notices.PushFailedNotice(request_id=request_id))

        for future in futures:
            future.add_done_callback(ended)
        ended()

    async def finish_heads(
        self,
        push: HeadPush,
        first_token: int,
        first_logprobs: TokenLogprobs | None,
        write: Callable[[list[int]], Awaitable[list[int]]],
    ) -> TransferStats:
        """Finish a push written head by head: ``write`` (the producer's blocks, one per
        destination block) writes every rank's heads and answers each rank's bytes (-1: failed);
        then the consumer's rank 0 gets the completion notice (or the failure notice). A
        cancelled caller (the client went away) first waits for ``write`` to end; a failure
        notice after a WRITE failed says a WRITE may still land (a rank's wait timed out), so
        the consumer keeps the blocks until its destination's expiry and margin."""
        destination, start = push.destination, time.perf_counter()
        rid, peer_id = destination.request_id, destination.engine_id
        peer = self._peer(peer_id, destination.incarnation, rid)
        writing: asyncio.Future | None = None
        try:
            if self.faults:
                await self.faults.hit_async("finish_push", rid, peer_id)
            writing = asyncio.ensure_future(write(push.block_ids()))
            try:
                counts = await asyncio.shield(writing)
            except asyncio.CancelledError:
                await asyncio.wait([writing])  # the ranks' WRITEs run on in their threads
                raise
            failed = [rank for rank, count in enumerate(counts) if count < 0]
            if failed:
                raise KVTransferError(f"tensor-parallel ranks {failed} could not write their KV", rid, peer_id)
        except BaseException:
            self._notify(peer, notices.PushFailedNotice(request_id=rid, settled=_wrote_all(writing)))
            raise
        self._notify(
            peer, notices.PushDoneNotice(request_id=rid, first_token=first_token, first_logprobs=first_logprobs)
        )
        rank_bytes = tuple(counts) if len(counts) > 1 else ()
        return TransferStats(sum(counts), time.perf_counter() - start, 0, rank_bytes=rank_bytes)

    def push_heads(
        self, destination: KVDestination, block_ids: list[int], heads: range, rank: int, producers: Sequence[RankPeer]
    ) -> tuple[int, int]:
        """Blocking: WRITE this pool's KV heads ``heads`` (the model's) of ``block_ids`` (the
        producer's, one per destination block) into the consumer ranks that take them from
        ``rank`` of ``producers`` (``kv_transport.heads.head_targets``) and wait for every WRITE;
        sends no notice; (bytes, rows). Nothing is posted once the destination's lease is over
        (the consumer frees the blocks then), and every posted WRITE is waited for, also when a
        later post fails, by one deadline: the lease's end."""
        rid, skip = destination.request_id, destination.skip_blocks
        self._check_unstaged(destination)
        src_blocks, dst_blocks = block_ids[skip:], destination.block_ids[skip:]
        deadline = time.monotonic() + min(self.timeout_s, destination.seconds_left())
        posted, num_bytes, num_rows = [], 0, 0
        try:
            for target, first, count in head_targets(destination, producers, rank, self.layout):
                peer = self._peer(target.engine_id, target.incarnation, rid)
                whole = count == peer.info.layout.num_kv_heads == self.layout.num_kv_heads
                local = rows(self._own_info(), src_blocks, None if whole else first - heads.start, count)
                remote = rows(peer.info, dst_blocks, None if whole else first - target.kv_head_start, count)
                if not len(local):
                    continue
                if time.monotonic() >= deadline:
                    raise KVTransferTimeout("the push's destination expired before its WRITEs", rid, target.engine_id)
                posted.append(
                    (self._post("WRITE", local, remote, peer, rid, deadline=destination.expires_at), target.engine_id)
                )
                num_bytes, num_rows = num_bytes + int(local[:, 1].sum()), num_rows + len(local)
        finally:
            failures = _wait_all(posted, deadline, rid)
        if failures:
            raise failures[0]
        return num_bytes, num_rows

    def _check_unstaged(self, described: KVHandle | KVDestination) -> None:
        """KV split by heads moves between pools NIXL sees (not through staging buffers)."""
        if self.staging is not None or isinstance(described, (staging_mod.StagedHandle, staging_mod.StagedDestination)):
            raise KVTransferError(
                "KV between engines that split the KV heads differently needs transport.staging=none",
                described.request_id,
                described.engine_id,
            )

    async def wait_push(self, destination: KVDestination) -> PushCompletion:
        rid = destination.request_id
        future = self._push_in[rid]
        try:
            # not wait_for: on 3.11 a cancel that meets the notice would be lost (the request gone, the push on)
            async with asyncio.timeout(max(0.0, min(self.timeout_s, destination.seconds_left()))):
                completion = await asyncio.wrap_future(future)
        except BaseException as exc:
            staged = self._staged_in.pop(rid, None)
            if staged is not None:  # the producer may still be writing into them
                self._free_slots_later(staged.slots)
            if isinstance(exc, TimeoutError):
                raise KVTransferTimeout(
                    f"no push completion within {self.timeout_s:.1f} s", rid, "producer of push"
                ) from None
            raise
        finally:
            self._push_in.pop(rid, None)
        self._landing.pop(rid, None)  # every WRITE landed before the done notice went
        staged = self._staged_in.pop(rid, None)
        if staged is not None:
            await self._copy_in(rid, staged)
        return completion

    async def _copy_in(self, request_id: str, staged: _StagedIn) -> None:
        """Staging consumer: copy the written slots into the pool, then free them. Failed or
        cancelled meanwhile, the slots are set aside, and the pool blocks held while a copy on a
        CUDA side stream may still write into them (``kv_transfer_timeout_s``)."""
        copy, queued = None, False
        try:
            copy = self.staging.to_pool(staged.slots, staged.block_ids)
            queued = True
            await staging_mod.wait_copied(copy)
        except BaseException:
            self._free_slots_later(staged.slots)
            if not queued or _may_still_copy(copy):  # failed while queueing: part may be queued
                self._hold(request_id)
            raise
        self.staging.slots.free(staged.slots)

    def abort_push(self, request_id: str) -> None:
        self.abort_head_push(self._head_push.pop(request_id, None))
        push = self._push_out.pop(request_id, None)
        if push is not None:
            self._fail_when_ended(push, request_id)
            self._free_slots(push.slots)
        waiter = self._push_in.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        staged = self._staged_in.pop(request_id, None)
        if staged is not None:  # the producer may still be writing into them
            self._free_slots_later(staged.slots)

    def abort_head_push(self, push: HeadPush | None) -> None:
        """A push written head by head that will not finish: its consumer hears so now."""
        if push is None:
            return
        destination = push.destination
        try:
            peer = self._peer(destination.engine_id, destination.incarnation, destination.request_id)
        except KVTransferError:  # stopped or restarted: nobody waits
            return
        self._notify(peer, notices.PushFailedNotice(request_id=destination.request_id))

    # ---- internals --------------------------------------------------------------------

    def _peer(self, engine_id: str, incarnation: str, request_id: str) -> _Peer:
        """The peer for a handle: handshaken once per incarnation, re-confirmed in the registry
        at most every ``peer_check_interval_s`` (a stopped or restarted peer is refused then)."""
        cached = self._peers.get((engine_id, incarnation))
        if cached is not None and time.monotonic() - cached.checked_at < self.peer_check_interval_s:
            return cached
        with self._peer_lock:  # the event loop and the engine thread (head-wise transfers) both ask
            return self._confirm_peer(engine_id, incarnation, request_id)

    def _confirm_peer(self, engine_id: str, incarnation: str, request_id: str) -> _Peer:
        """``_peer``'s registry check and first handshake (under ``_peer_lock``)."""
        cached = self._peers.get((engine_id, incarnation))
        now = time.monotonic()
        if cached is not None and now - cached.checked_at < self.peer_check_interval_s:
            return cached  # confirmed by another thread meanwhile
        try:
            info = self._registry.lookup(engine_id, incarnation, request_id)
        except StalePeerError:
            with self._lock:
                self._forget(engine_id)
            raise
        if cached is not None:
            cached.checked_at = now
            return cached
        self._worker.bind_cuda()  # the handshake unpacks the peer's (GPU) memory keys here
        with self._lock:
            self._forget(engine_id)
            try:
                name, notice_name = self._worker.add_peer(info.agent_metadata, info.notice_agent_metadata)
            except Exception as exc:
                raise KVTransferError(f"NIXL handshake failed: {exc!r}", request_id, engine_id) from exc
        geometry = PoolGeometry(
            info.pool_address, self.layout.num_layers, info.num_blocks, self._block_bytes, info.device_id
        )
        peer = _Peer(info, name, notice_name, now, geometry)
        self._peers[(engine_id, incarnation)] = peer
        self.num_handshakes += 1
        return peer

    def _forget(self, engine_id: str) -> None:
        """Drop every cached incarnation of ``engine_id`` (its metadata is never reused)."""
        for key in [k for k in self._peers if k[0] == engine_id]:
            peer = self._peers.pop(key)
            self._worker.remove_peer(peer.agent_name, peer.notice_agent)

    def _check_layout(self, theirs: KVLayout, request_id: str, peer: str) -> None:
        # a frozen dataclass compares its fields as one tuple: cheap on a pull's critical path
        if theirs != self.layout:
            raise LayoutMismatchError(
                f"KV layout mismatch: theirs {asdict(theirs)} != ours {asdict(self.layout)}",
                request_id,
                peer,
            )

    def _post(
        self,
        op: str,
        local: Descs,
        remote: Descs,
        peer: _Peer,
        request_id: str,
        posted_at: PostedAt | None = None,
        event: object | None = None,
        deadline: float | None = None,
    ) -> concurrent.futures.Future:
        """Queue a transfer for the progress thread; the future yields (state, done time). A
        WRITE into a push's destination has its expiry as ``deadline``: not posted after it."""
        post = Post(
            op,
            local,
            remote,
            peer.agent_name,
            peer.info.engine_id,
            peer.info.mem_type,
            request_id,
            concurrent.futures.Future(),
            posted_at,
            event,
            deadline,
        )
        return self._worker.post(post)

    async def _await_xfer(
        self, future: concurrent.futures.Future, timeout: float, request_id: str, peer: str, op: str
    ) -> float:
        try:
            if future.done():  # no trip through the event loop
                state, done_at = future.result()
            else:  # asyncio.timeout, not wait_for: a cancel that meets the transfer's end stays a cancel
                async with asyncio.timeout(timeout):
                    state, done_at = await asyncio.shield(asyncio.wrap_future(future))
        except TimeoutError:
            raise KVTransferTimeout(f"NIXL {op} not complete after {timeout:.1f} s", request_id, peer) from None
        if state != "DONE":
            raise KVTransferError(f"NIXL {op} ended in state {state}", request_id, peer)
        return done_at

    def _notify(self, peer: _Peer, notice: notices.Notice) -> None:
        self._worker.notify(peer.notice_agent, notices.encode(notice))

    def _send_done(self, push: _PushOut, notice: notices.PushDoneNotice) -> None:
        """Send a push's done notice, timed as it is handed over: a time taken after could fall
        after the consumer had read it."""
        sent_at = time.time()
        self._notify(push.peer, notice)
        push.notice_sent = sent_at

    def _expire_exports(self, now: float) -> None:
        """Progress thread, every round: free exports nobody claimed in time, and staging slots
        set aside after a failed transfer."""
        for request_id in [r for r, expiry in list(self._exports.items()) if expiry < now]:
            self._release(request_id, expired=True)  # unless released since the line above
        for entry in [e for e in list(self._slots_later) if e[0] < now]:
            self._slots_later.remove(entry)
            self.staging.slots.free(entry[1])
        with self._held_lock:
            for request_id in [r for r, at in self._landing.items() if at < now]:
                del self._landing[request_id]  # nobody asked (the transfer ended well, or was freed)
            due = [r for r, at in self._freeing.items() if at < now]
            for request_id in due:
                del self._freeing[request_id]
        for request_id in due:
            if self._release_blocks is not None:
                self._release_blocks(request_id)

    def frees_later(self, request_id: str) -> bool:
        with self._held_lock:
            until = self._landing.pop(request_id, 0.0)
            if until <= time.time():
                return False
            self._freeing[request_id] = until
            return True

    def _hold(self, request_id: str) -> None:
        """A transfer that ended unfinished may still write into the request's blocks: held for
        ``kv_transfer_timeout_s`` from now (or until ``_quiet``)."""
        until = time.time() + self.timeout_s
        with self._held_lock:
            if request_id in self._freeing:
                self._freeing[request_id] = until
            else:
                self._landing[request_id] = until

    def _quiet(self, request_id: str) -> None:
        """Any thread: nothing more lands in the request's blocks (its READ ended, or its
        producer's done or settled failure notice came): freed now, not at the time bound."""
        with self._held_lock:
            self._landing.pop(request_id, None)
            if request_id in self._freeing:
                self._freeing[request_id] = 0.0

    def _free_slots(self, slots: list[int]) -> None:
        if slots:
            self.staging.slots.free(slots)

    def _free_slots_later(self, slots: list[int]) -> None:
        """Staging slots a failed or aborted transfer may still write into (a READ that timed out,
        a producer still pushing): freed once ``kv_transfer_timeout_s`` has passed, so no other
        request's KV can be overwritten by a late write."""
        if slots:
            self._slots_later.append((time.time() + self.timeout_s, slots))

    def _on_notif(self, message: bytes) -> None:
        """Progress thread: one notice from a peer (see ``kv_transport.notices``)."""
        try:
            notice = notices.decode(message)
        except ValueError:
            logger.warning("ignored a malformed notice %r", message[:40])
            return
        if isinstance(notice, notices.ReleaseNotice):
            self.release(notice.request_id)
            return
        # a done or settled failure notice goes once none of the push's WRITEs can land: blocks
        # the consumer had handed over for a push it dropped are freed now (first: before a waiter hears)
        if not isinstance(notice, notices.PushFailedNotice) or notice.settled:
            self._quiet(notice.request_id)
        waiter = self._push_in.get(notice.request_id)
        if waiter is None or waiter.done():
            return
        if isinstance(notice, notices.PushDoneNotice):
            completion = PushCompletion(notice.first_token, notice.first_logprobs, received_at=time.time())
            waiter.set_result(completion)
        else:
            error = KVTransferError("the producer's push failed", notice.request_id, "producer of push")
            waiter.set_exception(error)


def _may_still_copy(copy: staging_mod.CopyEvent | None) -> bool:
    """A copy's event has not fired (or cannot say: a CUDA error)."""
    try:
        return copy is not None and not copy.query()
    except Exception:
        return True


def _wrote_all(writing: asyncio.Future | None) -> bool:
    """A head-wise push's ``write`` was never started, or every rank's WRITEs ended DONE (not
    when it still runs: its caller was cancelled again while waiting for it)."""
    if writing is None:
        return True
    if not writing.done() or writing.cancelled() or writing.exception() is not None:
        return False
    return min(writing.result(), default=0) >= 0


class _Reading(Generic[T]):
    """A head-wise READ to run on another thread (``NixlTransport.reading``): when it ends it
    says how long its blocks stay held; dropped (its caller cancelled) before it started, it
    never runs and holds them no longer."""

    def __init__(self, transport: NixlTransport, request_id: str, read: Callable[[], T], says_in_flight: bool) -> None:
        self.transport, self.request_id, self.read, self.says_in_flight = transport, request_id, read, says_in_flight
        self.lock, self.state = threading.Lock(), "queued"

    def __call__(self) -> T:
        rid, transport = self.request_id, self.transport
        with self.lock:
            if self.state == "dropped":
                raise KVTransferError("the pull was cancelled before its READ started", rid, "")
            self.state = "running"
        try:
            result = self.read()
        except BaseException as exc:
            settled = isinstance(exc, KVTransferError) and not isinstance(exc, ReadStillPosted)
            if self.says_in_flight and settled:
                transport._quiet(rid)
            else:
                transport._hold(rid)
            raise
        transport._quiet(rid)
        return result

    def drop(self) -> None:
        """Its caller is gone: a READ not started yet never will."""
        with self.lock:
            if self.state != "queued":
                return
            self.state = "dropped"
        self.transport._quiet(self.request_id)


def _wrote(future: concurrent.futures.Future) -> bool:
    """A completed transfer's future ended DONE."""
    return future.exception() is None and future.result()[0] == "DONE"


def _wait_all(
    posted: list[tuple[concurrent.futures.Future, str]], deadline: float, request_id: str
) -> list[KVTransferError]:
    """Blocking: wait for every posted WRITE until ``deadline`` (monotonic); the failures."""
    failures = []
    for done, peer_id in posted:
        try:
            _wait_done(done, max(0.0, deadline - time.monotonic()), request_id, peer_id, "WRITE")
        except KVTransferError as exc:
            failures.append(exc)
    return failures


def _wait_done(done: concurrent.futures.Future, timeout: float, request_id: str, peer: str, op: str = "READ") -> None:
    """Blocking: a transfer the progress thread completes."""
    try:
        state, _ = done.result(timeout)
    except concurrent.futures.TimeoutError:
        raise KVTransferTimeout(f"NIXL {op} not complete after {timeout:.1f} s", request_id, peer) from None
    if state != "DONE":
        raise KVTransferError(f"NIXL {op} ended in state {state}", request_id, peer)


def _pull_runs(handle: KVHandle, targets: list[int], skip_blocks: int) -> list[tuple[int, int, int]]:
    """``(remote start, target start, count)`` runs of a pull: the handle's blocks after
    ``skip_blocks`` (its staging slots when it has some) paired with ``targets``, one per block."""
    ranges = handle.staged_ranges if isinstance(handle, staging_mod.StagedHandle) else handle.block_ranges
    if not skip_blocks:
        return pair_ranges(ranges, id_ranges(targets))
    return coalesce(staging_mod.remote_block_ids(handle)[skip_blocks:], targets)
