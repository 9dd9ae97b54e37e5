"""The KV-state board (``deployments/kv_state.py``) in Ray's key-value store: a replica silent
for ``FORGET_AFTER_S`` (a crash; a graceful stop removes its own entries) is forgotten, and its
peer-registry entry with it, so a handle naming it is refused as stale, not read from a dead peer."""

from __future__ import annotations

import dataclasses
import time

import pytest

from deployments import kv_state
from engine.kv_layout import KVLayout
from kv_transport.registry import PeerInfo, RayPeerRegistry
from kv_transport.sharded import rank_engine_id

APP = "kv-state-test"  # no Serve application has this name: the real replicas' entries are not read


@pytest.fixture(scope="module")
def registry(shared_serve) -> RayPeerRegistry:
    shared_serve.ray()
    return RayPeerRegistry()


def _entry(engine_id: str, age_s: float, num_ranks: int) -> dict:
    ranks = [{"rank": rank} for rank in range(num_ranks)]
    return {"engine_id": engine_id, "app": APP, "deployment": "DecodeServer", "ranks": ranks,
            "published_at": time.time() - age_s}  # fmt: skip


def test_a_replica_silent_for_too_long_leaves_the_board_and_the_peer_registry(registry):
    """A crashed tensor-parallel replica (2 ranks, each with its own registry entry) beside a live one."""
    crashed = PeerInfo("decode-crashed", "i1", "agent", b"", b"", KVLayout(2, 1, 8, 16, "float32"), 0, 4, 0, "DRAM")
    crashed_rank = dataclasses.replace(crashed, engine_id=rank_engine_id("decode-crashed", 1))
    alive = dataclasses.replace(crashed, engine_id="decode-alive")
    alive_rank = dataclasses.replace(crashed, engine_id=rank_engine_id("decode-alive", 1))
    peers = (crashed, crashed_rank, alive, alive_rank)
    for info in peers:
        registry.publish(info)
    kv_state.publish("decode-crashed", _entry("decode-crashed", kv_state.FORGET_AFTER_S + 1, num_ranks=2))
    kv_state.publish("decode-alive", _entry("decode-alive", 0.0, num_ranks=2))
    try:
        assert [e["engine_id"] for e in kv_state.read_all(APP)] == ["decode-alive"]
        assert registry.current(crashed.engine_id) is None and registry.current(crashed_rank.engine_id) is None
        assert registry.current(alive.engine_id) == alive and registry.current(alive_rank.engine_id) == alive_rank
        assert [e["engine_id"] for e in kv_state.read_all(APP)] == ["decode-alive"]  # the board forgot it
    finally:
        for info in peers:
            kv_state.remove(info.engine_id)
            registry.remove(info.engine_id, info.incarnation)
