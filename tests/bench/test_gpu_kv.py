"""The pure parts of bench.gpu_kv: the cross-process registry's rules, the push figures from
layer timestamps, and the UCX protocol tables read back from a process's log."""

from __future__ import annotations

import pytest

from bench.gpu_kv import push_figures, ucx_transports
from bench.gpu_kv_side import PushRun, SharedDictRegistry
from engine.kv_pool import KVLayout
from kv_transport.base import LayerTiming, StalePeerError
from kv_transport.registry import PeerInfo

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="bfloat16")


def _info(incarnation: str) -> PeerInfo:
    return PeerInfo("prod", incarnation, "prod.a", b"meta", b"notice-meta", LAYOUT, 4096, 8, 0, "VRAM")


def test_shared_dict_registry_keeps_the_current_incarnation_only():
    entries: dict[str, bytes] = {}  # a Manager dict in the benchmark; the same mapping calls
    registry = SharedDictRegistry(entries)
    registry.publish(_info("one"))
    assert isinstance(entries["prod"], bytes)  # pickled: the manager's process needs no types
    assert registry.lookup("prod", "one") == _info("one")
    registry.publish(_info("two"))
    with pytest.raises(StalePeerError, match="incarnation one is stale"):
        registry.lookup("prod", "one")
    registry.remove("prod", "one")  # an old incarnation's stop leaves the new entry
    assert registry.current("prod") == _info("two")
    registry.remove("prod", "two")
    assert registry.current("prod") is None


def test_push_figures_measure_the_tail_from_the_last_compute_end():
    t0 = 1000.0
    times = (
        LayerTiming(layer=0, compute_end=t0 + 0.0009, posted=t0 + 0.0011, done=t0 + 0.0013),
        LayerTiming(layer=1, compute_end=t0 + 0.0019, posted=t0 + 0.0021, done=t0 + 0.0024),
    )
    run = PushRun(layer_times=times, compute_end=(t0 + 0.001, t0 + 0.002), num_bytes=2 * 4096)
    figures = push_figures(run, notice_at=t0 + 0.003)
    assert figures["layer_bytes"] == 4096
    assert figures["one_layer_ms"] == pytest.approx(0.25)  # median of 0.2 and 0.3
    assert figures["tail_to_last_write_ms"] == pytest.approx(0.4)
    assert figures["tail_to_notice_ms"] == pytest.approx(1.0)
    assert figures["tail_in_layers"] == pytest.approx(4.0)
    assert figures["compute_per_layer_ms"] == pytest.approx(1.0)
    assert figures["posted_after_compute_ms"] == pytest.approx(0.1)
    assert figures["call_before_compute_end_ms"] == pytest.approx(0.1)
    assert figures["last_layers"][-1] == {
        "layer": 1,
        "compute_end_ms": 0.0,
        "push_layer_called_ms": -0.1,
        "posted_ms": 0.1,
        "done_ms": 0.4,
    }


UCX_LOG = """\
[1796057766.20] [vm:9098 :0]   +--------+-------------+-------------------------------------------+
[1796057766.20] [vm:9098 :0]   | b intra-node cfg#1                                               |
[1796057766.20] [vm:9098 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796057766.20] [vm:9098 :0]   +--------+-------------+-------------------------------------------+
[1796057766.20] [vm:9098 :0]   | Range  | Description |                  Config                   |
[1796057766.20] [vm:9098 :0]   +--------+-------------+-------------------------------------------+
[1796057766.20] [vm:9098 :0]   | 0..inf | zero-copy   | cma/memory                                |
[1796057766.19] [vm:5618 :0]   | a intra-node cfg#1                                              |
[1796057766.19] [vm:5618 :0]   | active message by ucp_am_send* with reply flag from host memory |
[1796057766.19] [vm:5618 :0]   |   Range    |    Description     |            Config             |
[1796057766.19] [vm:5618 :0]   |          0 | short              | tcp/lo                        |
[1796057766.19] [vm:5618 :0]   |   1..16515 | zero-copy          | tcp/lo                        |
[1.8] [gb:1:5] | ucp_context_0 cfg#2 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[1.8] [gb:1:5] +--------------------------------+-------------------------------+---------------+
[1.8] [gb:1:5] |                         0..inf | zero-copy                     | cuda_ipc/cuda |
[1796057766.20] [vm:9098 :0]   | b intra-node cfg#1                                               |
[1796057766.20] [vm:9098 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796057766.20] [vm:9098 :0]   | 0..inf | zero-copy   | cma/memory                                |
"""


def test_ucx_transports_reads_the_rma_tables_gpu_first(tmp_path):
    (tmp_path / "consumer-1.log").write_text(UCX_LOG)
    assert ucx_transports(tmp_path) == [
        "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0]: zero-copy via cuda_ipc/cuda",
        "remote memory read by ucp_get*(multi) into host memory from host: zero-copy via cma/memory",
    ]
