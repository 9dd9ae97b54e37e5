"""Byte ranges of blocks in a pool ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``.

One block of one layer's K (or V) is one contiguous run of ``block_bytes``::

    offset(layer, kv, block) = ((layer * 2 + kv) * num_blocks + block) * block_bytes

A request's blocks are paired (source block i -> destination block i). Where both sides
are consecutive, the pairs coalesce into one descriptor per (layer, K/V) run.

This code sits on a pull's critical path, where Python is slow: building a request's
descriptors is a visible share of a pull (``docs/benchmarks/kv_transfer_probes.md``).
So blocks travel as ``(start, count)`` ranges, a consecutive list is recognised with one
comparison, and each pool's 2 x layers base addresses are computed once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kv_transport.handle import to_ranges

Descs = list[tuple[int, int, int]]  # NIXL (address, length, device id) rows
Ranges = Sequence[tuple[int, int]]  # (first block, count)


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pairs of block ids -> ``(src_start, dst_start, count)`` runs where both are consecutive."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    return pair_ranges(id_ranges(src), id_ranges(dst))


def id_ranges(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``handle.to_ranges`` as a list, with a consecutive list recognised in one comparison."""
    if not block_ids:
        return []
    first = block_ids[0]
    if block_ids[-1] - first == len(block_ids) - 1 and list(block_ids) == list(range(first, first + len(block_ids))):
        return [(first, len(block_ids))]
    return list(to_ranges(block_ids))


def pair_ranges(src: Ranges, dst: Ranges) -> list[tuple[int, int, int]]:
    """Two range lists of the same total length -> ``(src_start, dst_start, count)`` runs,
    split wherever either side's range ends."""
    if len(src) == 1 and len(dst) == 1 and src[0][1] == dst[0][1] > 0:
        return [(src[0][0], dst[0][0], src[0][1])]
    src_total, dst_total = sum(n for _, n in src), sum(n for _, n in dst)
    if src_total != dst_total:
        raise ValueError(f"{src_total} source blocks but {dst_total} destination blocks")
    runs: list[tuple[int, int, int]] = []
    i = j = 0
    s, sn = src[0] if src else (0, 0)
    d, dn = dst[0] if dst else (0, 0)
    while i < len(src) and j < len(dst):
        n = min(sn, dn)
        if n:
            runs.append((s, d, n))
        s, sn, d, dn = s + n, sn - n, d + n, dn - n
        if sn == 0 and (i := i + 1) < len(src):
            s, sn = src[i]
        if dn == 0 and (j := j + 1) < len(dst):
            d, dn = dst[j]
    return runs


class PoolGeometry:
    """Where one pool's blocks are: its ``2 x num_layers`` K/V base addresses, computed once."""

    def __init__(self, base_address: int, num_layers: int, num_blocks: int, block_bytes: int, device_id: int) -> None:
        self.block_bytes = block_bytes
        self.device_id = device_id
        self.bases = [base_address + layer_kv * num_blocks * block_bytes for layer_kv in range(2 * num_layers)]

    def descs(self, runs: Ranges, layers: Sequence[int] | None = None) -> Descs:
        """NIXL ``(address, length, device)`` rows for ``runs`` of ``(first block, count)`` in
        ``layers`` (all when None), K then V per layer."""
        size, device = self.block_bytes, self.device_id
        bases = (
            self.bases if layers is None else [self.bases[i] for layer in layers for i in (2 * layer, 2 * layer + 1)]
        )
        if len(runs) == 1:
            offset, length = runs[0][0] * size, runs[0][1] * size
            return [(base + offset, length, device) for base in bases]
        pieces = [(start * size, count * size) for start, count in runs]
        return [(base + offset, length, device) for base in bases for offset, length in pieces]


def head_rows(
    base_address: int,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    pool_heads: int,
    head_bytes: int,
    device_id: int,
    blocks: Sequence[int],
    first_head: int | None = None,
    num_heads: int | None = None,
) -> np.ndarray:
    """NIXL rows (``[n, 3]``: address, length, device) of KV heads ``[first_head, first_head +
    num_heads)`` of ``blocks`` in a pool holding ``pool_heads``, every layer K then V, block by
    block: one row per token (a head range of a block is ``block_size`` strided pieces in this
    layout); ``first_head=None``: one row per whole block. Two sides built with the same
    blocks count and head count pair row for row."""
    block_bytes = block_size * pool_heads * head_bytes
    layer_kv = np.arange(2 * num_layers, dtype=np.int64)[:, None] * (num_blocks * block_bytes)
    starts = base_address + layer_kv + np.asarray(blocks, dtype=np.int64)[None, :] * block_bytes
    if first_head is None:
        addresses, length = starts.reshape(-1), block_bytes
    else:
        tokens = np.arange(block_size, dtype=np.int64) * (pool_heads * head_bytes) + first_head * head_bytes
        addresses, length = (starts[:, :, None] + tokens).reshape(-1), num_heads * head_bytes
    rows = np.empty((addresses.size, 3), dtype=np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addresses, length, device_id
    return rows
