"""``python -m planner simulate`` and its trace reader: bad traces and inputs exit with code 2
naming the file, line or field and write nothing; a slice of the Azure trace gives the same
decisions twice for a seed; GPU-hours count every replica held, those that never start too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoscaling.policy import Scaling, load_policy
from planner.__main__ import main
from planner.replay import run, with_defaults
from planner.sim_types import ElasticWorld, SimRequest
from planner.simulator import simulate
from planner.trace import TraceError, read_trace, scale_rate, window
from tests.planner.test_roofline import LLAMA_3_8B
from tests.planner.test_simulator import disagg

AZURE = Path(__file__).parents[2] / "workloads" / "traces" / "azure_llm_2023_conv.csv"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROOT_CALIBRATION = Path(__file__).parents[2] / "planner" / "calibration" / "cpu-2core.json"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    return path


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_azure_trace_reads_with_its_times_and_lengths():
    requests = read_trace(AZURE)
    assert len(requests) == 19_366 and requests[0].arrival_s == 0.0
    assert (requests[0].prompt_tokens, requests[0].output_tokens) == (374, 44)
    assert requests[1].arrival_s == pytest.approx(4.314579)  # 18:15:50.9951690 - 18:15:46.6805900
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(requests, requests[1:]))
    assert 3500 < requests[-1].arrival_s < 3600


def test_jsonl_traces_take_arrival_or_send_times_and_either_output_name(tmp_path):
    rows = [
        {"arrival_s": 5.0, "prompt_tokens": 10, "max_tokens": 3},
        {"sent": 6.5, "prompt_tokens": 4, "output_tokens": 2},
    ]
    path = _write(tmp_path, "t.jsonl", "\n".join(map(json.dumps, rows)) + "\n\n")
    assert read_trace(path) == [SimRequest(0.0, 10, 3), SimRequest(1.5, 4, 2)]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad.csv",
            HEADER + "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,12,x\n",
            "bad.csv:3: output tokens 'x'",
        ),
        (
            "neg.csv",
            HEADER + "2023-11-16 18:15:46.68,-5,44\n",
            "neg.csv:2: prompt tokens '-5' is not a positive integer",
        ),
        ("zero.csv", HEADER + "1.0,3,0\n", "zero.csv:2: output tokens is 0"),
        ("order.csv", HEADER + "2023-11-16 18:15:47,1,1\n2023-11-16 18:15:46,1,1\n", "order.csv:3: arrives 1.000000 s"),
        ("short.csv", HEADER + "1.0,3\n", "short.csv:2: 2 fields, the header has 3"),
        ("cols.csv", "TIMESTAMP,Prompt,GeneratedTokens\n1,2,3\n", "cols.csv:1: missing column(s) ContextTokens"),
        ("when.csv", HEADER + "yesterday,1,1\n", "when.csv:2: TIMESTAMP 'yesterday'"),
        (
            "rows.jsonl",
            '{"arrival_s": 0, "prompt_tokens": 3, "max_tokens": 1}\n{"arrival_s": 1,\n',
            "rows.jsonl:2: not JSON",
        ),
        ("keys.jsonl", '{"arrival_s": 0, "prompt": "hi", "max_tokens": 1}\n', "keys.jsonl:1: needs arrival_s"),
        ("text.txt", "hello\n", "text.txt:1: not an Azure CSV trace"),
        ("empty.csv", HEADER, "empty.csv: the trace holds no request"),
    ],
)
def test_a_bad_trace_is_refused_naming_its_line(tmp_path, name, text, message):
    with pytest.raises(TraceError) as error:
        read_trace(_write(tmp_path, name, text))
    assert str(error.value).startswith(f"{tmp_path}/{message}")


def test_the_rate_scale_replays_each_request_k_times_within_a_second():
    requests = [SimRequest(0.0, 5, 1), SimRequest(10.0, 7, 2)]
    scaled = scale_rate(requests, 3, seed=1)
    assert len(scaled) == 6 and scaled == scale_rate(requests, 3, seed=1)
    assert [r.prompt_tokens for r in scaled] == [5, 5, 5, 7, 7, 7]
    assert all(0.0 <= r.arrival_s - base < 1.0 for r, base in zip(scaled, [0.0] * 3 + [10.0] * 3))
    assert window(scaled, 5.0, 10.0) == [SimRequest(r.arrival_s - 5.0, 7, 2) for r in scaled[3:]]


def _cli(*args: str) -> list[str]:
    return ["simulate", "--slo-ttft", "2", "--slo-tpot", "0.1", *args]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "{trace}", "--gpu", "h100"], "--model and --gpu are needed"),
        (["--trace", "{trace}", "--model", "{model}", "--gpu", "h100", "--policy", "nope"], "--policy nope:"),
        (["--trace", "{trace}", "--model", "{bare}", "--gpu", "h100"], "--model {bare} / --gpu h100:"),
        (
            ["--trace", "{trace}", "--model", "{model}", "--gpu", "h100", "--rate-scale", "0"],
            "--rate-scale must be >= 1",
        ),
        (["--trace", "{bad}", "--model", "{model}", "--gpu", "h100"], "{bad}:3: arrives"),
        (["--trace", "{trace}", "--model", "{model}", "--gpu", "h100", "--policy", "{policy}"], "--policy {policy}:"),
    ],
)
def test_bad_inputs_exit_2_naming_the_field_and_write_nothing(tmp_path, llama, capsys, args, message):
    names = {
        "trace": _write(tmp_path, "ok.csv", HEADER + "1,10,5\n2,10,5\n"),
        "bad": _write(tmp_path, "bad.csv", HEADER + "2,10,5\n1,10,5\n"),
        "model": llama,
        "bare": _write(tmp_path, "bare.json", json.dumps({"model_type": "llama"})),
        "policy": _write(tmp_path, "p.yaml", "slo: {ttft_p90_ms: 1, tpot_p90_ms: 1}\ncooldown_s: -3\n"),
    }
    out = tmp_path / "out"
    argv = [a.format(**names) for a in args] + ["--out", str(out)]
    assert main(_cli(*argv)) == 2
    assert message.format(**names) in capsys.readouterr().err
    assert not out.exists()


def test_a_slice_of_the_azure_trace_gives_the_same_decisions_twice(tmp_path, llama, capsys):
    """500 rows of the production trace at twice its rate on 1 prefill + 1 decode H100 replica
    under the default policy: the autoscaler acts, and a second run of the same seed decides the
    same at the same instants. The files carry the overall figures, one row per window."""
    first = AZURE.read_text().splitlines()[:501]
    trace = _write(tmp_path, "slice.csv", "\n".join(first) + "\n")
    argv = _cli("--trace", str(trace), "--model", str(llama), "--gpu", "h100", "--policy", "default",
                "--rate-scale", "2", "--window-s", "30", "--seed", "3")  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "simulation.json").read_text()) for d in "ab")
    assert a["requests"] == 1000 and a["decisions"] and a["decisions"] == b["decisions"]
    assert a["overall"] | {"duration_s": 0} == b["overall"] | {"duration_s": 0}
    assert sum(w["requests"] for w in a["windows"]) == 1000 and (tmp_path / "a" / "timeline.png").stat().st_size > 0
    assert {d["kind"] for d in a["decisions"]} <= {"lend", "reclaim", "drained", "scale_up", "scale_down", "give_up"}
    assert all(d["reason"] for d in a["decisions"])
    assert "1000 requests simulated" in capsys.readouterr().out


def test_gpu_hours_are_replica_seconds_times_the_tp_degree(tmp_path, llama):
    trace = _write(tmp_path, "t.csv", HEADER + "".join(f"{i},200,20\n" for i in range(20)))
    args = with_defaults(trace=trace, model=str(llama), gpu="h100", slo_ttft=2.0, slo_tpot=0.1, prefill=2, decode=3,
                         tp_decode=2)  # fmt: skip
    data = run(args)
    duration = data["overall"]["duration_s"]
    assert data["overall"]["gpu_hours"] == pytest.approx((2 * 1 + 3 * 2) * duration / 3600)
    assert data["overall"]["attainment"] == 1.0 and data["gpus_per_replica"] == {"prefill": 1, "decode": 2}


def test_replicas_that_never_start_are_held_until_given_up():
    """Every new replica fails to start: the policy gives them up after ``pending_timeout_s``,
    the decode pool keeps its one replica, and the replicas asked for are paid for until then."""
    policy = load_policy("default")
    world = ElasticWorld(startup_s=30.0, never_start=0.999, seed=1)
    burst = [SimRequest(0.25 * i, 32, 200) for i in range(400)]
    result = simulate(disagg(policy=policy, world=world), burst)
    kinds = [(d.kind, d.pool) for d in result.decisions if d.pool == "decode"]
    assert ("scale_up", "decode") in kinds and ("give_up", "decode") in kinds
    assert max(s.decode for s in result.timeline) == 1 and max(s.starting for s in result.timeline) >= 1
    up = next(d for d in result.decisions if d.kind == "scale_up" and d.pool == "decode")
    give_up = next(d for d in result.decisions if d.kind == "give_up" and d.pool == "decode")
    assert give_up.time_s - up.time_s >= policy.scaling.pending_timeout_s and give_up.new == 1
    assert result.replica_seconds["decode"] > result.records[-1].arrival_s


def test_the_controller_sees_loads_as_late_as_the_report_delay():
    lending_only = load_policy("default").model_copy(update={"scaling": Scaling(enabled=False)})
    burst = [SimRequest(0.1 * i, 32, 200) for i in range(120)]
    prompt, late = (
        simulate(disagg(policy=lending_only, world=ElasticWorld(report_delay_s=delay)), burst) for delay in (0.0, 5.0)
    )
    first = [next(d.time_s for d in r.decisions if d.kind == "lend") for r in (prompt, late)]
    assert first[1] >= first[0] + 5.0


def test_prompt_placement_sends_a_prefill_backlog_to_the_decode_replica():
    """400-token prompts every second queue at the one prefill replica (1.2 s each on the
    calibrated CPU cost): once the measured prefill speed predicts a TTFT over the SLO and the
    decodes have TPOT room, the ingress's own rules place prompts on the decode replica, and
    the TTFT p90 falls against the same policy without placement, at a higher TPOT."""
    policy = load_policy("default").model_copy(update={"scaling": Scaling(enabled=False)})
    off = policy.model_copy(update={"prompt_placement": policy.prompt_placement.model_copy(update={"enabled": False})})
    requests = [SimRequest(1.0 * i, 400, 100) for i in range(60)]
    placed, alone = (simulate(disagg(policy=p), requests) for p in (policy, off))
    assert placed.routes["on_decode"] > 0 and alone.routes["on_decode"] == 0
    assert sum(placed.routes.values()) == sum(alone.routes.values()) == 60
    placed_p90, alone_p90 = (r.percentiles() for r in (placed, alone))
    assert placed_p90["ttft_s"]["p90"] < alone_p90["ttft_s"]["p90"]
    assert placed_p90["tpot_s"]["p90"] > alone_p90["tpot_s"]["p90"]


def test_a_colocated_system_pays_for_its_replicas_and_takes_no_policy(tmp_path, llama):
    trace = _write(tmp_path, "t.csv", HEADER + "0,100,10\n1,100,10\n")
    args = with_defaults(trace=trace, model=str(llama), gpu="h100", slo_ttft=2.0, slo_tpot=0.1, colocated=3)
    data = run(args)
    assert data["gpus_per_replica"] == {"colocated": 1} and data["routes"] == {}
    assert data["overall"]["gpu_hours"] == pytest.approx(3 * data["overall"]["duration_s"] / 3600)


def test_the_study_runs_every_system_on_a_slice_and_renders_from_its_json(tmp_path, capsys):
    """``python -m planner.study`` on the trace's first 10 minutes at its own rate: every system
    ran on the same requests, the oracle's windows hold the sizing target, and ``--render``
    rewrites the same page from the JSON alone."""
    from planner.study import SIZE_TARGET, SYSTEMS
    from planner.study import main as study

    assert study(["--engine", "1.2x", "--rate-scale", "1", "--duration-s", "600", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "elastic_at_scale.json").read_text())["1.2x"]
    assert set(data["systems"]) == set(SYSTEMS) and data["settings"]["requests"] == sum(data["arrivals_per_window"])
    hours = {name: s["overall"]["gpu_hours"] for name, s in data["systems"].items()}
    assert all(h > 0 for h in hours.values()) and hours["g"] <= hours["b"] * 1.0001
    assert all(row["attainment"] >= SIZE_TARGET for row in data["systems"]["g"]["sizes"])
    page = (tmp_path / "elastic_at_scale.md").read_text()
    assert "## Engine profile `1.2x`" in page and "| f holds 90% in every window |" in page
    assert study(["--render", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "elastic_at_scale.md").read_text() == page
    assert (tmp_path / "elastic_at_scale_1.2x.png").stat().st_size > 0
    capsys.readouterr()


def test_the_cpu_calibration_simulates_this_machine_and_refuses_a_gpu_or_tp(tmp_path, capsys):
    trace = _write(tmp_path, "t.csv", HEADER + "0,100,8\n2,100,8\n")
    calibration = str(ROOT_CALIBRATION)
    data = run(with_defaults(trace=trace, calibration=Path(calibration), slo_ttft=5.0, slo_tpot=0.5))
    assert data["requests"] == 2 and data["overall"]["attainment"] == 1.0
    assert data["overall"]["ttft_p90_s"] > 0.1  # a 100-token prefill on one CPU thread, plus the served stack
    argv = _cli("--trace", str(trace), "--calibration", calibration)
    assert main([*argv, "--gpu", "h100"]) == 2 and "not both" in capsys.readouterr().err
    assert main([*argv, "--tp-decode", "2"]) == 2 and "no TP degree" in capsys.readouterr().err
