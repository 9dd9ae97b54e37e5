"""KV between tensor-parallel engines of any degrees, pull and push: each rank moves its own KV heads.

Every rank of an engine has its own NIXL agent over its own pool, which holds that rank's KV
heads for the same block ids (rank 0 allocates for all). A producer's handle and a consumer's
destination name each rank (``ranks``: about 82 bytes per rank pickled; a TP-3 handle of the
default model is 729 bytes against 483, a destination 734 against 488). The consumer's
rank r takes the model's KV heads it holds from the producer ranks that hold them
(``heads.head_sources``) and nothing else; a head held by several producer ranks (replicated)
comes from one of them, chosen by r so that replicas share the load; a head the consumer
replicates goes to each of its ranks.

Pull: rank 0 of the consumer sends every rank the command (``FetchHeads``, in the engine's step
channel), reads its own share, gathers the byte counts and only then tells the producer to
release its blocks. Push: the producer records its blocks as the forward pass names them
(``push_layer``) and, once prefill is done, rank 0 sends ``PushHeads``: every producer rank
writes what each consumer rank takes from it (``heads.head_targets``) and waits for its WRITEs;
then rank 0 tells the consumer's rank 0 (whose ranks need nothing else). So a push between
different splits is not layer-pipelined: its WRITEs start after the last layer.

Where a rank's heads are all of a producer rank's heads and all of its own (the same degree), a
block of a layer's K or V is one contiguous run; otherwise the pool layout ``[layers, 2, blocks,
block_size, heads, head_dim]`` makes a head range of a block ``block_size`` strided pieces, one
descriptor each (``descriptors.head_rows``; the choice against a heads-major layout and its
cost: ``docs/benchmarks/tensor_parallel.md``); the descriptors: ``kv_transport.heads``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.params import TokenLogprobs
from engine.tensor_parallel import shard_for
from kv_transport.base import (
    BaseKVTransport,
    KVTransferError,
    PushCompletion,
    ReadStillPosted,
    ReleaseBlocks,
    TransferStats,
)
from kv_transport.config import TransportConfig
from kv_transport.handle import KVDestination, KVHandle, RankPeer
from kv_transport.heads import HeadPush

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.model_runner import ModelRunner
    from engine.tensor_parallel import RankGroup
    from engine.tp_worker import Leader
    from kv_transport.nixl_transport import NixlTransport

logger = logging.getLogger(__name__)

PEER_KEY = "kv-peer/{rank}"


def rank_engine_id(engine_id: str, rank: int) -> str:
    return f"{engine_id}#r{rank}"


@dataclass(frozen=True)
class FetchHeads:
    """Rank 0 to every rank: read your KV heads of ``handle``'s blocks into ``block_ids``."""

    handle: KVHandle
    block_ids: tuple[int, ...]
    skip_blocks: int


@dataclass(frozen=True)
class PushHeads:
    """Rank 0 to every rank: write your KV heads of ``block_ids`` (one per destination block)
    into the consumer ranks that take them from you; ``producers``: this engine's ranks."""

    destination: KVDestination
    block_ids: tuple[int, ...]
    producers: tuple[RankPeer, ...]


class _RankTransport:
    """A rank's transport and what runs rank 0's ``FetchHeads`` and ``PushHeads`` there."""

    def __init__(self, transport: NixlTransport, heads: range, rank: int) -> None:
        self.transport, self.heads, self.rank = transport, heads, rank

    def __call__(self, command: FetchHeads | PushHeads) -> int:
        if isinstance(command, PushHeads):
            args = (command.destination, list(command.block_ids), self.heads, self.rank, command.producers)
            return self.transport.push_heads(*args)[0]
        return read_heads(self.transport, command, self.heads, self.rank)

    def close(self) -> None:
        self.transport.close()


STILL_POSTED = -2  # a rank's answer to FetchHeads: failed with a READ still posted (it may land)


def read_heads(transport: NixlTransport, command: FetchHeads, heads: range, rank: int) -> int:
    """One rank's share of a ``FetchHeads``: its bytes, or ``STILL_POSTED`` (other failures raise:
    the rank answers -1, and nothing of its READs can land any more)."""
    args = (command.handle, list(command.block_ids), command.skip_blocks, heads, rank)
    try:
        return transport.fetch_heads(*args)[0]
    except ReadStillPosted as exc:
        logger.warning("tensor-parallel rank %d: %s", rank, exc)
        return STILL_POSTED


def checked_reads(counts: list[int], request_id: str) -> list[int]:
    """Every rank's answer to a ``FetchHeads``, or the error that says whether a READ may still land."""
    failed = [rank for rank, count in enumerate(counts) if count < 0]
    if not failed:
        return counts
    message = f"tensor-parallel ranks {failed} could not read their KV"
    if STILL_POSTED in counts:  # rank 0's transport holds the blocks until it cannot land
        raise ReadStillPosted(message + " (a READ may still land)", request_id, "?")
    raise KVTransferError(message, request_id, "?")


@dataclass(frozen=True)
class RankKV:
    """``engine.tp_worker.RankExtension``: a rank's own NIXL agent over its own pool."""

    config: TransportConfig
    engine_id: str

    def start(self, runner: ModelRunner, group: RankGroup) -> _RankTransport:
        from kv_transport.factory import make_transport

        pool = runner.pool
        transport = make_transport(self.config, rank_engine_id(self.engine_id, group.rank), pool.layout)
        transport.register_pool(pool.tensor, lambda request_id: None)  # rank 0's allocator owns the blocks
        transport.stay_awake()
        group.publish(PEER_KEY.format(rank=group.rank), f"{transport.engine_id} {transport.incarnation}")
        heads = shard_for(runner.model.config, group.rank, group.degree).kv_head_range
        return _RankTransport(transport, heads, group.rank)


class ShardedTransport(BaseKVTransport):
    """Rank 0's transport in a tensor-parallel engine: its own agent (``inner``) for rank 0's
    heads, the other ranks' reads and writes run by command."""

    def __init__(self, inner: NixlTransport, engine: AsyncEngine, leader: Leader, model_config: object) -> None:
        self.inner, self.engine, self.leader = inner, engine, leader
        self.engine_id, self.incarnation, self.layout = inner.engine_id, inner.incarnation, inner.layout
        self.degree = leader.group.degree
        self._model_config = model_config
        self.heads = shard_for(model_config, 0, self.degree).kv_head_range
        self.ranks: tuple[RankPeer, ...] = ()
        self._pushes: dict[str, HeadPush] = {}

    def register_pool(self, pool: torch.Tensor, release_blocks: ReleaseBlocks) -> None:
        self.inner.register_pool(pool, release_blocks)
        peers = [(self.inner.engine_id, self.inner.incarnation)]
        peers += [tuple(self.leader.group.read(PEER_KEY.format(rank=r)).split()) for r in range(1, self.degree)]
        ranks = []
        for rank, (engine_id, incarnation) in enumerate(peers):
            heads = shard_for(self._model_config, rank, self.degree).kv_head_range
            ranks.append(
                RankPeer(
                    engine_id=engine_id, incarnation=incarnation, kv_head_start=heads.start, num_kv_heads=len(heads)
                )
            )
        self.ranks = tuple(ranks)

    def export(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int) -> KVHandle:
        handle = self.inner.export(request_id, block_ids, num_tokens, first_token)
        return handle.model_copy(update={"ranks": self.ranks})

    async def fetch(self, handle: KVHandle, local_block_ids: list[int], skip_blocks: int = 0) -> TransferStats:
        start = time.perf_counter()
        command = FetchHeads(handle, tuple(local_block_ids), skip_blocks)
        own: Callable[[], int] = lambda: read_heads(self.inner, command, self.heads, 0)  # noqa: E731
        # on the engine thread, even if this call is cancelled
        every_rank = lambda: checked_reads(self.leader.command(command, own), handle.request_id)  # noqa: E731
        read = self.inner.reading(handle, every_rank, says_in_flight=True)
        try:
            counts = await self.engine.run(read)
        except BaseException:  # cancelled: the command still runs on the engine thread, unless dropped first
            read.drop()
            raise
        self.inner.give_back(handle)  # every rank has its heads: the producer may free the blocks
        return TransferStats(sum(counts), time.perf_counter() - start, 0, rank_bytes=tuple(counts))

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    @property
    def num_expired_exports(self) -> int:
        return self.inner.num_expired_exports

    def give_back(self, handle: KVHandle) -> None:
        self.inner.give_back(handle)

    def frees_later(self, request_id: str) -> bool:
        return self.inner.frees_later(request_id)

    def close(self) -> None:
        self.inner.close()

    # ---- push: every rank writes its KV heads once the forward pass is done ------------------

    def destination(self, request_id: str, block_ids: list[int], num_tokens: int, skip_blocks: int = 0):
        destination = self.inner.destination(request_id, block_ids, num_tokens, skip_blocks)
        return destination.model_copy(update={"ranks": self.ranks})

    def begin_push(self, destination: KVDestination) -> None:
        self._pushes[destination.request_id] = HeadPush(destination)

    def push_layer(self, request_id: str, layer: int, local_block_ids: Sequence[int], start_index: int) -> None:
        push = self._pushes.get(request_id)
        if push is not None:
            push.record(local_block_ids, start_index)

    async def finish_push(
        self, request_id: str, first_token: int, first_logprobs: TokenLogprobs | None = None
    ) -> TransferStats:
        push = self._pushes.pop(request_id)
        destination = push.destination

        async def write(block_ids: list[int]) -> list[int]:
            command = PushHeads(destination, tuple(block_ids), self.ranks)
            own: Callable[[], int] = lambda: self.inner.push_heads(destination, block_ids, self.heads, 0, self.ranks)[0]  # noqa: E731
            return await self.engine.run(lambda: self.leader.command(command, own))

        return await self.inner.finish_heads(push, first_token, first_logprobs, write)

    async def wait_push(self, destination: KVDestination) -> PushCompletion:
        return await self.inner.wait_push(destination)  # the producer tells rank 0 once every rank's heads are in

    def abort_push(self, request_id: str) -> None:
        self.inner.abort_head_push(self._pushes.pop(request_id, None))
        self.inner.abort_push(request_id)
