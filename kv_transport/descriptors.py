"""Byte ranges of blocks in a pool ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``.

One block of one layer's K (or V) is one contiguous run of ``block_bytes``::

    offset(layer, kv, block) = ((layer * 2 + kv) * num_blocks + block) * block_bytes

A request's blocks are paired (source block i -> destination block i). Where both sides
are consecutive, the pairs coalesce into one descriptor per (layer, K/V) run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pairs of block ids -> ``(src_start, dst_start, count)`` runs where both are consecutive."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def block_descs(
    base_address: int,
    num_blocks: int,
    block_bytes: int,
    device_id: int,
    layers: Sequence[int],
    runs: Sequence[tuple[int, int]],
) -> np.ndarray:
    """NIXL ``(address, length, device)`` rows for ``runs`` of ``(first block, count)`` in ``layers``, K then V."""
    rows = [
        (base_address + ((layer * 2 + kv) * num_blocks + start) * block_bytes, count * block_bytes, device_id)
        for layer in layers
        for kv in (0, 1)
        for start, count in runs
    ]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)
