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

APP = "kv-state-test"  # no Serve application has this name: the real replicas' entries are not read


@pytest.fixture(scope="module")
def registry(shared_serve) -> RayPeerRegistry:
    shared_serve.ray()
    return RayPeerRegistry()


def _entry(engine_id: str, age_s: float) -> dict:
    return {"engine_id": engine_id, "app": APP, "deployment": "DecodeServer", "published_at": time.time() - age_s}


def test_a_replica_silent_for_too_long_leaves_the_board_and_the_peer_registry(registry):
    crashed = PeerInfo("decode-crashed", "i1", "agent", b"", b"", KVLayout(2, 1, 8, 16, "float32"), 0, 4, 0, "DRAM")
    alive = dataclasses.replace(crashed, engine_id="decode-alive")
    for info, age_s in ((crashed, kv_state.FORGET_AFTER_S + 1), (alive, 0.0)):
        registry.publish(info)
        kv_state.publish(info.engine_id, _entry(info.engine_id, age_s))
    try:
        assert [e["engine_id"] for e in kv_state.read_all(APP)] == ["decode-alive"]
        assert registry.current("decode-crashed") is None
        assert registry.current("decode-alive") == alive
        assert [e["engine_id"] for e in kv_state.read_all(APP)] == ["decode-alive"]  # the board forgot it
    finally:
        for info in (crashed, alive):
            kv_state.remove(info.engine_id)
            registry.remove(info.engine_id, info.incarnation)
