"""Byte ranges of blocks in a pool ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``.

One block of one layer's K (or V) is one contiguous run of ``block_bytes``::

    offset(layer, kv, block) = ((layer * 2 + kv) * num_blocks + block) * block_bytes

A request's blocks are paired (source block i -> destination block i). Where both sides
are consecutive, the pairs coalesce into one descriptor per (layer, K/V) run.
"""

from __future__ import annotations

from collections.abc import Sequence

Descs = list[tuple[int, int, int]]  # NIXL (address, length, device id) rows


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
) -> Descs:
    """NIXL ``(address, length, device)`` rows for ``runs`` of ``(first block, count)`` in ``layers``, K then V.

    Plain tuples: for the few dozen rows of a request this beats numpy, whose first calls
    after the process idled cost ~0.1 ms on the transfer's critical path.
    """
    stride = num_blocks * block_bytes
    pieces = [(base_address + start * block_bytes, count * block_bytes) for start, count in runs]
    return [
        (address + layer_kv * stride, length, device_id)
        for layer in layers
        for layer_kv in (2 * layer, 2 * layer + 1)
        for address, length in pieces
    ]
