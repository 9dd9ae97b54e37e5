"""Which rank holds which KV heads, and NIXL rows for a head range of a pool's blocks (KV
between tensor-parallel engines, pull and push: ``kv_transport.sharded``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.kv_layout import KVLayout
from kv_transport.base import KVTransferError, LayoutMismatchError
from kv_transport.descriptors import head_rows
from kv_transport.handle import KVDestination, KVHandle, RankPeer


@dataclass(frozen=True)
class PoolInfo:
    """Where a pool is (the fields of ``registry.PeerInfo`` that ``rows`` reads)."""

    layout: KVLayout
    pool_address: int
    num_blocks: int
    device_id: int


@dataclass
class HeadPush:
    """A push written head by head once the forward pass is done (the two sides split the KV
    heads differently): the producer's block of each destination block, as ``push_layer`` names them."""

    destination: KVDestination
    blocks: dict[int, int] = field(default_factory=dict)  # destination index -> producer block

    def record(self, block_ids: Sequence[int], start_index: int) -> None:
        for index, block in enumerate(block_ids, start_index):
            self.blocks[index] = block

    def block_ids(self) -> list[int]:
        """One producer block per destination block (-1 before ``skip_blocks``: not written)."""
        destination = self.destination
        count, skip = len(destination.block_ids), destination.skip_blocks
        missing = [i for i in range(skip, count) if i not in self.blocks]
        if missing:
            raise KVTransferError(f"blocks {missing} of the push were never computed", destination.request_id, "")
        return [self.blocks.get(i, -1) for i in range(count)]


def rows(info: Any, blocks: Sequence[int], first_head: int | None, num_heads: int) -> np.ndarray:
    """``descriptors.head_rows`` for the pool ``info`` describes (a ``PeerInfo`` or ``PoolInfo``)."""
    layout = info.layout
    head_bytes = layout.head_dim * torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    return head_rows(
        info.pool_address,
        layout.num_layers,
        info.num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        head_bytes,
        info.device_id,
        blocks,
        first_head,
        num_heads,
    )


def head_sources(handle: KVHandle, heads: range, layout: KVLayout, rank: int) -> list[tuple[RankPeer, int, int]]:
    """Pull: ``(producer rank, first head, count)`` runs covering the model's KV heads ``heads``
    (those of the consumer's rank ``rank``)."""
    check_compatible(handle, layout)
    return _assign(handle.peers(), heads, rank, handle)


def head_targets(
    destination: KVDestination, producers: Sequence[RankPeer], rank: int, layout: KVLayout
) -> list[tuple[RankPeer, int, int]]:
    """Push: ``(consumer rank, first head, count)`` runs the producer's rank ``rank`` writes:
    for every consumer rank, its KV heads whose source (as a pull by that rank would choose it)
    is ``rank``. ``producers``: the producer's ranks (one that holds every head for one rank)."""
    check_compatible(destination, layout)
    mine = producers[rank]
    targets = []
    for index, consumer in enumerate(destination.peers()):
        heads = range(consumer.kv_head_start, consumer.kv_head_start + consumer.num_kv_heads)
        targets += [
            (consumer, first, n) for src, first, n in _assign(producers, heads, index, destination) if src is mine
        ]
    return targets


def check_compatible(blocks: KVHandle | KVDestination, layout: KVLayout) -> None:
    """The other side's pool must differ from this one's in its KV heads only."""
    theirs = blocks.layout
    if (theirs.num_layers, theirs.head_dim, theirs.block_size, theirs.dtype) != (
        layout.num_layers,
        layout.head_dim,
        layout.block_size,
        layout.dtype,
    ):
        raise LayoutMismatchError(f"KV layout mismatch: theirs {theirs} != ours {layout}", blocks.request_id, "?")


def _assign(
    sources: Sequence[RankPeer], heads: range, rank: int, blocks: KVHandle | KVDestination
) -> list[tuple[RankPeer, int, int]]:
    """``(source, first head, count)`` runs covering ``heads``: a head several sources hold
    (replicated) comes from the one ``rank`` picks, so that the holders share the load."""
    runs: list[list] = []
    for head in heads:
        holders = [s for s in sources if s.kv_head_start <= head < s.kv_head_start + s.num_kv_heads]
        if not holders:
            raise LayoutMismatchError(f"no rank holds KV head {head}", blocks.request_id, blocks.engine_id)
        source = holders[rank % len(holders)]
        if runs and runs[-1][0] is source and runs[-1][1] + runs[-1][2] == head:
            runs[-1][2] += 1
        else:
            runs.append([source, head, 1])
    return [(s, first, count) for s, first, count in runs]
