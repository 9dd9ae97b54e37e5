"""The CPU-testable parts of bench.gpu_kv: the registry the two processes share, the figures of a
pull and of a push, a row's failure, the UCX protocol tables read back from a log, the printed
tables (from the committed run's JSON), and the simulated forward on CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest

from bench import gpu_kv
from bench.gpu_kv import (
    CPU_PLAN,
    GPU_PLAN,
    BandwidthResult,
    PushRun,
    SharedDictRegistry,
    _LayerCompute,
    guarded,
    pull_figures,
    push_figures,
    push_row,
    render,
    side_call,
    ucx_transports,
)
from engine.kv_pool import KVLayout
from kv_transport.base import LayerTiming, StalePeerError
from kv_transport.registry import PeerInfo

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="bfloat16")
COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "gpu_kv.json"


def _info(incarnation: str) -> PeerInfo:
    return PeerInfo("prod", incarnation, "prod.a", b"meta", b"notice-meta", LAYOUT, 4096, 8, 0, "VRAM")


def test_shared_dict_registry_keeps_the_current_incarnation_only():
    entries: dict[str, PeerInfo] = {}  # a Manager dict in the benchmark; the same mapping calls
    registry = SharedDictRegistry(entries)
    registry.publish(_info("one"))
    assert entries["prod"] == _info("one") and registry.lookup("prod", "one") == _info("one")
    registry.publish(_info("two"))
    with pytest.raises(StalePeerError, match="incarnation one is stale"):
        registry.lookup("prod", "one")
    registry.remove("prod", "one")  # an old incarnation's stop leaves the new entry
    assert registry.current("prod") == _info("two")
    registry.remove("prod", "two")
    assert registry.current("prod") is None and entries == {}


def test_plan_sizes_pools_and_raw_buffers_in_whole_blocks():
    assert CPU_PLAN.layout.bytes_per_block == 65_536  # 8 layers x K/V x 16 tokens x 2 heads x 64 x 2 bytes
    assert [CPU_PLAN.blocks_for(mb) for mb in CPU_PLAN.sizes_mb] == [16, 64]
    assert CPU_PLAN.pool_blocks == 64 + 8 and CPU_PLAN.raw_bytes == 2 * 4 << 20  # a gap after each piece


def test_pull_figures_take_medians_after_the_warm_up():
    times = {"raw": (9.0, 0.001, 0.003, 0.002), "raw_split": (9.0, 0.004, 0.004, 0.004), "pull": (9.0, 0.002, 0.002)}
    row = pull_figures(BandwidthResult(times, num_descriptors=16, bytes_ok=True), 16, 1 << 20)
    assert row["size_mb"] == 1.0 and row["num_blocks"] == 16 and row["num_descriptors"] == 16
    assert row["raw_us"] == pytest.approx(2000) and row["pull_us"] == pytest.approx(2000)
    assert row["pull_gb_per_s"] == pytest.approx((1 << 20) / 0.002 / 1e9)
    assert row["pull_vs_raw"] == pytest.approx(1.0) and row["pull_vs_raw_split"] == pytest.approx(2.0)
    staged = pull_figures(BandwidthResult({"pull": (9.0, 0.004)}, 16, False), 16, 1 << 20)  # no raw READ beside it
    assert set(staged) == {"size_mb", "num_blocks", "num_descriptors", "pull_us", "pull_gb_per_s", "bytes_ok"}


def _push_run(t0: float) -> PushRun:
    times = (
        LayerTiming(layer=0, compute_end=t0 + 0.0009, posted=t0 + 0.0011, done=t0 + 0.0013),
        LayerTiming(layer=1, compute_end=t0 + 0.0019, posted=t0 + 0.0021, done=t0 + 0.0024),
    )
    return PushRun(layer_times=times, compute_end=(t0 + 0.001, t0 + 0.002), num_bytes=2 * 4096)


class FakePair:
    """Answers the commands of a push as the two processes would; each push's notice comes
    ``tails[rep]`` seconds after its last layer's forward."""

    def __init__(self, tails: list[float]) -> None:
        self.plan, self.tails, self.commands = CPU_PLAN, tails, []

    def ensure_started(self, deadline: float) -> None:
        pass

    def submit(self, role: str, command: str, *args: object):
        self.commands.append((role, command, args))
        return command

    def call(self, role: str, command: str, *args: object, deadline: float):
        self.commands.append((role, command, args))
        return _push_run(1000.0) if command == "push" else f"dest-{len(self.commands)}"

    def wait(self, future: str, deadline: float):
        tail = self.tails[sum(command == "push" for _, command, _ in self.commands) - 1]
        return 1000.002 + tail, True if len(self.commands) == 3 else None


def test_push_row_takes_medians_after_a_warm_up_that_checks_the_bytes():
    pair = FakePair(tails=[0.050, 0.001, 0.003, 0.002])  # the warm-up's tail left out
    row = push_row(pair, "none", deadline=0.0)
    assert row["tail_to_notice_ms"] == pytest.approx(2.0) and row["bytes_ok"] is True
    assert row["one_layer_ms"] == pytest.approx(0.25) and row["num_layers"] == CPU_PLAN.layout.num_layers
    waits = [args for role, command, args in pair.commands if command == "wait_push"]
    assert [verify for _, _, verify in waits] == [True, False, False, False]  # the warm-up's bytes are checked


def test_push_figures_measure_the_tail_from_the_last_compute_end():
    read = push_figures(_push_run(1000.0), 1000.0045, received_at=1000.003)
    assert read["tail_to_notice_ms"] == pytest.approx(2.5) and read["tail_to_notice_read_ms"] == pytest.approx(1.0)
    row = push_row(FakePair(tails=[0.001] * 4), "host", deadline=0.0)
    assert row["tail_to_notice_read_ms"] is None  # the pair gave no time the notice was read
    assert row["layer_bytes"] == 4096
    assert row["tail_to_last_write_ms"] == pytest.approx(0.4) and row["tail_in_layers"] == pytest.approx(4.0)
    assert row["compute_per_layer_ms"] == pytest.approx(1.0) and row["posted_after_compute_ms"] == pytest.approx(0.1)
    assert row["call_before_compute_end_ms"] == pytest.approx(0.1)
    assert row["last_layers"][-1] == {
        "layer": 1,
        "compute_end_ms": 0.0,
        "push_layer_called_ms": -0.1,
        "posted_ms": 0.1,
        "done_ms": 0.4,
    }


class FailingPair(FakePair):
    started, killed = False, 0

    def log_tails(self) -> str:
        return "  [consumer-1] the log's last line"

    def kill(self) -> None:
        self.killed += 1


def test_a_failed_row_is_its_result_and_kills_the_pair(capsys):
    pair = FailingPair([])

    budget = CPU_PLAN.row_timeout_s + CPU_PLAN.start_timeout_s  # the row's time, the processes' start included

    def hangs(deadline: float) -> dict:
        assert started + budget <= deadline <= time.monotonic() + budget
        raise TimeoutError("no answer | within the row's time")

    started = time.monotonic()
    row = guarded(pair, started + 100, hangs)
    assert row == {"error": "failed: TimeoutError: no answer / within the row's time"} and pair.killed == 1
    assert "[consumer-1] the log's last line" in capsys.readouterr().err
    assert guarded(pair, time.monotonic(), hangs) == {"error": "skipped: out of time"}


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


def test_render_prints_the_committed_run():
    text = "\n".join(render(json.loads(COMMITTED.read_text())))
    assert "| none | 256.0 | 128 | 64 | 1823.0 | 678.1 | 558.30 | 0.31 | 0.82 | yes |" in text
    assert "| host | 64.0 | 32 | 64 |  |  | 4.08 |  |  | yes |" in text  # a staged row: no raw READ beside it
    # the push: tail / one layer, and when the notice went
    assert "| none | 1.002 | 0.059 | 1.133 | 19.21 | 0.327 | 4.70 | 0.524 | yes |" in text
    assert "| 31 | 0.000 | -29.231 | 0.320 | 0.375 |" in text and "| median of all layers | 0 | -14.785 |" in text
    assert "ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]: zero-copy via cuda_ipc/cuda" in text


def test_render_prints_a_failed_row_as_its_error():
    result = {"plan": dataclasses.asdict(GPU_PLAN), "pull_vs_raw": [{"requested_mb": 256, "error": "failed: Timeout"}]}
    assert "| none | 256 | failed: Timeout |" in render(result)


def test_the_simulated_forward_on_cpu_ends_each_layer_after_its_duration():
    compute = _LayerCompute(CPU_PLAN)
    compute.start()
    for _ in range(3):
        with compute.layer():
            pass
    ends = compute.ends()
    assert len(ends) == 3 and all(b - a >= CPU_PLAN.compute_ms / 1e3 for a, b in zip(ends, ends[1:]))


def test_a_worker_runs_its_sides_commands_awaiting_the_coroutines(monkeypatch):
    class FakeSide:
        def close(self) -> str:
            return "closed"

        async def wait_push(self, destination: str) -> str:
            await asyncio.sleep(0)
            return f"notice for {destination}"

    monkeypatch.setattr(gpu_kv, "_WORKER", {"side": FakeSide(), "loop": asyncio.new_event_loop()})
    assert side_call("wait_push", "dest-1") == "notice for dest-1" and side_call("close") == "closed"
    gpu_kv._WORKER["loop"].close()
