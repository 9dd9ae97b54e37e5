"""``python -m autoscaling.replay``: a recorded trace replayed under a policy prints the same table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoscaling.decide import ActionKind
from autoscaling.policy import POLICY_DIR, load_policy
from autoscaling.replay import main, read_trace, replay
from autoscaling.snapshot import Observed, ReplicaLoad, Snapshot
from engine.params import Role

REPO = Path(__file__).resolve().parents[2]

LEND_ROW = (
    "| 0.0 | lend | p0 | decode pressed: decode waiting 5.00 >= enter 2.00; "
    "prefill calm: prefill queued_prompt_tokens 0.00 <= leave 128 |"
)
RECLAIM_ROW = (
    "| 6.0 | reclaim | p0 | decode burst over: decode kv_usage 0.00 <= leave 0.40, "
    "decode waiting 0.00 <= leave 0.00, decode running_per_replica 0.00 <= leave 2.00 |"
)
DRAINED_ROW = "| 7.0 | drained | p0 | decoding 0: its decodes ended, prefill only |"


def _replica(name: str, home: Role, role: Role, *, waiting: int = 0, decoding: int = 0) -> ReplicaLoad:
    return ReplicaLoad(
        replica=name,
        deployment="PrefillServer" if home is Role.PREFILL else "DecodeServer",
        home=home,
        role=role,
        running=decoding + waiting,
        decoding=decoding,
        waiting=waiting,
        queued_prompt_tokens=0,
        free_blocks=64,
        pinned_blocks=0,
        total_blocks=64,
        median_step_ms=12.5,
    )


def _burst_then_calm() -> list[Snapshot]:
    """1+1 replicas from t=100: decode requests wait for 6 s (p0 lent from the first), then calm."""
    snapshots = []
    for t in range(100, 121):
        burst = t < 106
        p0 = _replica("p0", Role.PREFILL, Role.BOTH if burst and t > 100 else Role.PREFILL)
        d0 = _replica("d0", Role.DECODE, Role.DECODE, waiting=5 if burst else 0)
        snapshots.append(Snapshot(time=float(t), replicas=(p0, d0)))
    return snapshots


def _write_trace(path: Path, snapshots: list[Snapshot]) -> Path:
    path.write_text("".join(json.dumps(s.to_json()) + "\n" for s in snapshots))
    return path


def test_replay_prints_the_lend_then_the_reclaim_with_reasons(tmp_path, capsys):
    trace = _write_trace(tmp_path / "trace.jsonl", _burst_then_calm())
    assert main(["default", str(trace)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        "policy default: 21 snapshots, 3 decisions",
        "| time (s) | action | replica or pool | reason |",
        "|---|---|---|---|",
        LEND_ROW,
        RECLAIM_ROW,
        DRAINED_ROW,
    ]


def _replay_module(trace) -> subprocess.CompletedProcess:
    """``python -m autoscaling.replay default TRACE`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "autoscaling.replay", "default", str(trace)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_replay_as_a_module_prints_the_same_table(tmp_path, capsys):
    trace = _write_trace(tmp_path / "trace.jsonl", _burst_then_calm())
    assert main(["default", str(trace)]) == 0
    in_process = capsys.readouterr().out
    done = _replay_module(trace)
    assert done.returncode == 0, done.stderr
    assert done.stdout == in_process


def test_another_policy_decides_otherwise_on_the_same_trace(tmp_path, capsys):
    trace = _write_trace(tmp_path / "trace.jsonl", _burst_then_calm())
    policy = load_policy("cost_first")  # waiting enter 4, cooldown 20: lends at once, keeps it to the end
    assert main([str(POLICY_DIR / "cost_first.yaml"), str(trace)]) == 0  # by path
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "policy cost_first: 21 snapshots, 2 decisions"
    assert [line.split(" | ")[1:3] for line in lines[3:]] == [["lend", "p0"], ["reclaim", "p0"]]
    assert lines[4].startswith("| 20.0 | reclaim | p0 | decode burst over: ")
    assert [a.kind for _, a in replay(read_trace(trace), policy)] == [ActionKind.LEND, ActionKind.RECLAIM]


def test_replay_is_deterministic():
    snapshots = _burst_then_calm()
    policy = load_policy("default")
    first = replay(snapshots, policy)
    assert first == replay(snapshots, policy)
    assert [(t, a.kind, a.replica) for t, a in first] == [
        (100.0, ActionKind.LEND, "p0"),
        (106.0, ActionKind.RECLAIM, "p0"),
        (107.0, ActionKind.DRAINED, "p0"),
    ]


@pytest.mark.parametrize(
    "bad_line",
    ["{not json", '{"replicas": []}', "[1, 2]", '{"time": 1, "replicas": [{"replica": "p0"}]}'],
    ids=["not-json", "no-time", "not-an-object", "replica-fields-missing"],
)
def test_a_malformed_line_exits_2_naming_the_line(tmp_path, capsys, bad_line):
    snapshots = _burst_then_calm()
    trace = tmp_path / "trace.jsonl"
    # line 3 is blank: lines are counted as the file has them
    lines = [json.dumps(snapshots[0].to_json()), json.dumps(snapshots[1].to_json()), "", bad_line]
    trace.write_text("\n".join(lines) + "\n")
    assert main(["default", str(trace)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {trace}:4: not a snapshot (")


def test_a_malformed_line_exits_2_as_a_module(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(_burst_then_calm()[0].to_json()) + "\n{oops\n")
    done = _replay_module(trace)
    assert done.returncode == 2
    assert f"{trace}:2: not a snapshot" in done.stderr and done.stdout == ""


def test_a_missing_trace_or_policy_exits_2(tmp_path, capsys):
    assert main(["default", str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    trace = _write_trace(tmp_path / "trace.jsonl", _burst_then_calm())
    assert main(["no_such_policy", str(trace)]) == 2
    assert "no policy 'no_such_policy' (shipped: cost_first, default, gpu, latency_first" in capsys.readouterr().err


def test_a_policy_that_is_not_yaml_exits_2(tmp_path, capsys):
    policy = tmp_path / "broken.yaml"
    policy.write_text("slo: {ttft_p90_ms: 3000\nmax_lent: [\n")
    trace = _write_trace(tmp_path / "trace.jsonl", _burst_then_calm())
    assert main([str(policy), str(trace)]) == 2
    assert "broken.yaml" in capsys.readouterr().err


def test_an_empty_trace_has_no_decisions(tmp_path, capsys):
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n")
    assert main(["latency_first", str(trace)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "policy latency_first: 0 snapshots, 0 decisions"


def test_a_snapshot_survives_its_json_form():
    snapshot = Snapshot(
        time=12.5,
        replicas=(
            _replica("p0", Role.PREFILL, Role.BOTH, decoding=3),
            _replica("d0", Role.DECODE, Role.DECODE, waiting=2, decoding=7),
        ),
        observed=Observed(num_requests=9, ttft_p90_s=0.8, tpot_p90_s=0.05, prefill_p90_s=0.6),
    )
    wire = json.loads(json.dumps(snapshot.to_json()))
    assert wire["replicas"][0]["home"] == "prefill" and wire["replicas"][0]["role"] == "both"
    back = Snapshot.from_json(wire)
    assert back == snapshot
    assert back.replicas[0].role is Role.BOTH and back.replicas[0].lent
    assert Snapshot.from_json({"time": 1.0, "replicas": []}) == Snapshot(time=1.0)


def test_the_apps_slo_replaces_the_policys_in_a_replay(tmp_path, capsys):
    """Decode requests wait throughout; from t=110 the prefill part of TTFT is 2.4 s: 0.8x the
    default policy's 3 s target (below its enter 1.0: the replica stays lent), 1.2x a 2 s
    target set by the app (reclaimed, naming the ratio)."""
    slow_prefill = Observed(num_requests=9, prefill_p90_s=2.4)
    snapshots = [
        Snapshot(
            time=float(t),
            replicas=(
                _replica("p0", Role.PREFILL, Role.BOTH if t > 100 else Role.PREFILL),
                _replica("d0", Role.DECODE, Role.DECODE, waiting=5),
            ),
            observed=slow_prefill if t >= 110 else Observed(),
        )
        for t in range(100, 121)
    ]
    trace = _write_trace(tmp_path / "trace.jsonl", snapshots)
    assert main(["default", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| lend | p0 |" in out and "reclaim" not in out
    assert main(["default", str(trace), "--slo-ttft-ms", "2000"]) == 0
    assert (
        "| 10.0 | reclaim | p0 | prompts press: prefill ttft_slo_ratio 1.20 >= enter 1.00 |" in capsys.readouterr().out
    )
