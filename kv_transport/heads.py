"""Which producer rank holds which KV heads, and NIXL rows for a head range of a pool's blocks
(the pull between tensor-parallel engines: ``kv_transport.sharded``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.kv_pool import KVLayout
from kv_transport.base import LayoutMismatchError
from kv_transport.descriptors import head_rows
from kv_transport.handle import KVHandle, RankPeer


@dataclass(frozen=True)
class PoolInfo:
    """Where a pool is (the fields of ``registry.PeerInfo`` that ``rows`` reads)."""

    layout: KVLayout
    pool_address: int
    num_blocks: int
    device_id: int


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
    """``(producer rank, first head, count)`` runs covering the model's KV heads ``heads``."""
    theirs = handle.layout
    if (theirs.num_layers, theirs.head_dim, theirs.block_size, theirs.dtype) != (
        layout.num_layers,
        layout.head_dim,
        layout.block_size,
        layout.dtype,
    ):
        raise LayoutMismatchError(f"KV layout mismatch: theirs {theirs} != ours {layout}", handle.request_id, "?")
    one = RankPeer(
        engine_id=handle.engine_id, incarnation=handle.incarnation, kv_head_start=0, num_kv_heads=theirs.num_kv_heads
    )
    sources = handle.ranks or (one,)
    runs: list[list] = []
    for head in heads:
        holders = [s for s in sources if s.kv_head_start <= head < s.kv_head_start + s.num_kv_heads]
        if not holders:
            raise LayoutMismatchError(f"no producer rank holds KV head {head}", handle.request_id, handle.engine_id)
        source = holders[rank % len(holders)]
        if runs and runs[-1][0] is source and runs[-1][1] + runs[-1][2] == head:
            runs[-1][2] += 1
        else:
            runs.append([source, head, 1])
    return [(s, first, count) for s, first, count in runs]
