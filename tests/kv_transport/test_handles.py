"""Handles, block ranges and descriptor coalescing (no transfers)."""

from __future__ import annotations

import pickle
import time

import pytest
from pydantic import ValidationError

from engine.kv_pool import KVLayout
from kv_transport.descriptors import PoolGeometry, coalesce, id_ranges, pair_ranges
from kv_transport.handle import KVHandle, from_ranges, to_ranges

SMOL = KVLayout(dtype="float32", num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)


def test_ranges_round_trip():
    ids = [4, 5, 6, 9, 10, 2]
    assert to_ranges(ids) == ((4, 3), (9, 2), (2, 1))
    assert from_ranges(to_ranges(ids)) == ids
    assert to_ranges([]) == ()


def test_coalesce_pairs_only_where_both_sides_are_consecutive():
    assert coalesce([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]
    assert coalesce([0, 1, 2, 3], [10, 11, 20, 21]) == [(0, 10, 2), (2, 20, 2)]
    assert coalesce([0, 1, 5, 6], [7, 8, 9, 10]) == [(0, 7, 2), (5, 9, 2)]
    assert coalesce([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    with pytest.raises(ValueError, match="3 source blocks but 2 destination blocks"):
        coalesce([1, 2, 3], [1, 2])


def test_block_descriptors_address_each_layer_and_kv_run():
    # pool [layers=2, 2, num_blocks=8, ...] with 100-byte blocks at base 1000
    pool = PoolGeometry(1000, num_layers=2, num_blocks=8, block_bytes=100, device_id=0)
    expected = [
        (1000 + (0 * 8 + 2) * 100, 300, 0),  # layer 0 K
        (1000 + (1 * 8 + 2) * 100, 300, 0),  # layer 0 V
        (1000 + (2 * 8 + 2) * 100, 300, 0),  # layer 1 K
        (1000 + (3 * 8 + 2) * 100, 300, 0),  # layer 1 V
    ]
    assert pool.descs([(2, 3)]) == expected
    assert pool.descs([(2, 3)], layers=[1]) == expected[2:]
    # two runs: per layer and K/V, each run in order
    assert pool.descs([(0, 1), (5, 2)], layers=[0]) == [(1000, 100, 0), (1500, 200, 0), (1800, 100, 0), (2300, 200, 0)]


def test_block_ranges_pair_up_where_either_side_breaks():
    assert id_ranges([7, 8, 9]) == [(7, 3)]
    assert id_ranges([7, 9, 8]) == [(7, 1), (9, 1), (8, 1)]
    assert id_ranges([]) == []
    assert pair_ranges([(0, 22)], [(398, 22)]) == [(0, 398, 22)]
    assert pair_ranges([(3, 0)], [(5, 0)]) == []  # no zero-length descriptors
    # a handle's ranges against scattered local blocks
    assert pair_ranges([(0, 3), (10, 2)], [(5, 1), (20, 4)]) == [(0, 5, 1), (1, 20, 2), (10, 22, 2)]
    with pytest.raises(ValueError, match="5 source blocks but 4 destination blocks"):
        pair_ranges([(0, 5)], [(0, 4)])


def test_handle_for_4096_tokens_is_under_2kb():
    blocks = list(range(100, 356))  # 256 blocks of 16 tokens
    handle = KVHandle(
        request_id="chatcmpl-" + "f" * 32,
        engine_id="prefill-replica-7f3a9c",
        incarnation="0123456789ab",
        block_ranges=to_ranges(blocks),
        num_tokens=4096,
        first_token=49151,
        layout=SMOL,
        expires_at=time.time() + 60,
    )
    assert len(handle.model_dump_json()) < 2048
    assert len(pickle.dumps(handle)) < 2048
    # even fully fragmented blocks (every other block) stay small enough to ship
    scattered = handle.model_copy(update={"block_ranges": to_ranges(range(0, 512, 2))})
    assert len(scattered.block_ids) == 256 and scattered.block_ids[:3] == [0, 2, 4]


def test_handles_are_versioned_and_frozen():
    handle = KVHandle(
        request_id="r",
        engine_id="e",
        incarnation="i",
        block_ranges=((0, 1),),
        num_tokens=3,
        first_token=5,
        layout=SMOL,
        expires_at=0.0,
    )
    assert handle.version == 1 and handle.seconds_left() < 0
    with pytest.raises(ValidationError):
        KVHandle.model_validate({**handle.model_dump(), "version": 2})
    with pytest.raises(ValidationError):
        handle.num_tokens = 4
