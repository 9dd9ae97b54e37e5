"""bench.elastic's report on hand-made records (no Ray): attainment per phase against each
class's SLO, the timeline's bins and in-flight counts, the targets, and a report rendered from
the raw folder that keeps the hand-written text around its generated block."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from bench import elastic
from bench.elastic import (
    NAME,
    Calibration,
    Phase,
    SystemRun,
    attainment_bins,
    by_class,
    each_system,
    floor_lines,
    in_flight,
    load_raw,
    make_phases,
    make_trace,
    parse_options,
    phase_scores,
    save_raw,
    system_args,
    targets,
    write_report,
)
from bench.host import tokenizer
from bench.report import markers
from bench.slo import SLO
from workloads import BenchRequest

BEGIN, END = markers(NAME)

PHASES = (
    Phase("prompt-heavy 1", "prompt", (380, 440), (24, 40), 0.45, 0.0, 30.0),
    Phase("decode burst", "burst", (32, 64), (160, 220), 1.0, 30.0, 60.0),
    Phase("prompt-heavy 2", "prompt", (380, 440), (24, 40), 0.45, 60.0, 90.0),
)
# prompt class: TTFT SLO 5 x 1.0 = 5 s; burst: 5 x 0.2 = 1 s; TPOT SLO 2 x mean(0.04, 0.06) = 0.1 s
SLO_PROMPT = SLO(5.0, 0.08)  # one class: TTFT 5 x 1.0 s, TPOT 2 x 0.04 s
CALIBRATION = Calibration(
    classes={
        "prompt": {"prompt_tokens": 410, "ttft_s": 1.0, "tpot_s": 0.04},
        "burst": {"prompt_tokens": 48, "ttft_s": 0.2, "tpot_s": 0.06},
    },
    model="m",
)


def _row(phase: int, arrival_s: float, ttft_s: float, tpot_s: float, tokens: int = 11, error: str | None = None):
    """A request sent at its arrival; ``tokens`` chunks, the first at ``ttft_s``, then every ``tpot_s``."""
    chunks = [] if error else [round(ttft_s + k * tpot_s, 6) for k in range(tokens)]
    record = {
        "prompt_tokens": 400,
        "max_tokens": tokens,
        "sent": 0.0,
        "chunks": chunks,
        "last": chunks[-1] if chunks else None,
        "usage_prompt_tokens": 400,
        "usage_output_tokens": None if error else tokens,
        "error": error,
    }
    return {"phase": phase, "arrival_s": arrival_s, "sent_s": arrival_s, "record": record}


def _run(system: str, rows: list[dict], **extra) -> SystemRun:
    return SystemRun(system=system, command="cmd", elapsed_s=120.0, duration_s=95.0, rows=rows, **extra)


def _static() -> SystemRun:
    return _run(
        "static",
        [
            _row(0, 1.0, 2.0, 0.05),  # met
            _row(0, 20.0, 6.0, 0.05),  # TTFT over the prompt class's 5 s
            _row(1, 31.0, 0.5, 0.3),  # TPOT over 0.1 s
            _row(1, 40.0, 2.0, 0.05),  # TTFT 2 s: within the prompt SLO, over the burst class's 1 s
            _row(2, 61.0, 1.0, 0.05, error="HTTP 503"),  # failed: a miss
            _row(2, 70.0, 4.9, 0.09),  # met
        ],
    )


def _elastic() -> SystemRun:
    rows = [_row(0, 1.0, 2.0, 0.05), _row(0, 20.0, 2.0, 0.05), _row(1, 31.0, 0.5, 0.08), _row(1, 40.0, 0.9, 0.05)]
    rows += [_row(2, 61.0, 1.0, 0.05), _row(2, 70.0, 6.0, 0.05)]
    timeline = [
        {"t": 32.0, "replicas": [{"deployment": "PrefillServer", "role": "prefill"}], "in_flight": {}, "observed": {}},
        {"t": 36.0, "replicas": [{"deployment": "PrefillServer", "role": "both"}], "in_flight": {}, "observed": {}},
    ]
    decisions = [{"t": 35.2, "action": "lend", "replica": "r1", "role": "both", "reason": "decode running 7 >= 6"}]
    return _run("elastic", rows, timeline=timeline, decisions=decisions)


def test_attainment_per_phase_uses_each_class_slo():
    scores = phase_scores(_static(), PHASES, CALIBRATION)
    assert [s["attainment"] for s in scores.values()] == [0.5, 0.0, 0.5, 2 / 6]
    assert scores["prompt-heavy 2"]["failed"] == 1
    assert scores["overall"]["requests"] == 6 and scores["overall"]["failed"] == 1
    assert scores["decode burst"]["tpot_p90_s"] == pytest.approx(0.05 + 0.9 * 0.25)  # numpy linear p90 of 0.05, 0.3


def test_attainment_bins_group_requests_by_arrival():
    bins = attainment_bins(_static(), PHASES, CALIBRATION, bin_s=15.0)
    assert [t for t, _ in bins] == [0.0, 15.0, 30.0, 45.0, 60.0, 75.0]
    values = [a for _, a in bins]
    assert values[:3] == [1.0, 0.0, 0.0] and math.isnan(values[3]) and values[4] == 0.5 and math.isnan(values[5])


def test_in_flight_counts_requests_between_send_and_last_token():
    rows = [_row(0, 0.0, 1.0, 0.5, tokens=5), _row(0, 1.5, 0.5, 0.75, tokens=3), _row(0, 2.0, 1.0, 0.1, error="x")]
    times, counts = in_flight(_run("static", rows))  # ends at 3.0 and 3.5; the failed one has no span
    assert times == [0.0, 1.0, 2.0, 3.0]
    assert counts == [1, 1, 2, 1]


def test_targets_compare_elastic_with_the_others():
    scores = {s.system: phase_scores(s, PHASES, CALIBRATION) for s in (_static(), _elastic())}
    scores["colocated"] = phase_scores(_run("colocated", _elastic().rows[:3]), PHASES, CALIBRATION)
    (overall, overall_value, overall_bar), (burst, burst_value, burst_bar) = targets(scores, "decode burst")
    assert overall == "elastic overall >= max(static, colocated) + 10 points"
    assert overall_value == pytest.approx(5 / 6) and overall_bar == pytest.approx(1.0 + 0.1)  # colocated 3/3
    assert burst == "elastic in the decode burst >= static + 20 points"
    assert burst_value == 1.0 and burst_bar == pytest.approx(0.2)
    assert targets({"elastic": scores["elastic"]}, "decode burst")[0][2] is None  # no static: no bar


def _floor() -> dict:
    return {
        "command": "python -m bench.elastic --stage floor",
        "batch": 8,
        "rounds": 4,
        "steps": 100,
        "prefill_prompt_tokens": 400,
        "decode_step_idle_ms": 80.0,
        "decode_step_with_prefill_ms": 100.0,
        "prefill_alone_s": 1.2,
        "prefill_beside_decode_s": 1.4,
        "busy_cores_idle": 1.02,
        "busy_cores_with_prefill": 1.98,
        "streams": 8,
        "client_tpot_idle_ms": 45.0,
        "replica_step_idle_ms": 42.0,
        "client_tpot_loaded_ms": 90.0,
        "replica_step_loaded_ms": 84.0,
    }


def _phases() -> list[dict]:
    return [asdict(p) for p in PHASES]


def test_report_rendered_from_the_raw_folder_keeps_the_hand_written_text(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    save_raw(raw, "trace", {"seed": 3, "command": "python -m bench.elastic --phase-s 30", "phases": _phases()})
    save_raw(raw, "calibration", CALIBRATION)
    for run in (_static(), _elastic()):
        save_raw(raw, f"system_{run.system}", run)
    save_raw(raw, "floor", _floor())
    out.mkdir()
    (out / "elastic.md").write_text(f"# Title\n\n{BEGIN}\nstale table\n{END}\n\n## Reading the results\n\nMine.\n")

    report = load_raw(raw)
    assert report["phases"] == PHASES and report["calibration"] == CALIBRATION
    assert list(report["runs"]) == ["static", "elastic"]
    write_report(report, out)

    text = (out / "elastic.md").read_text()
    assert text.startswith("# Title\n\n" + BEGIN) and text.endswith(END + "\n\n## Reading the results\n\nMine.\n")
    assert "stale table" not in text
    assert "| static | 50% | 0% | 50% | 33% | 1 | 2.0 |" in text
    assert "| elastic | 100% | 100% | 50% | 83% | 0 | 2.0 |" in text
    assert "| elastic in the decode burst >= static + 20 points | 100% | 20% | ok |" in text
    assert "| elastic overall >= max(static, colocated) + 10 points | n/a | n/a | n/a |" in text
    assert "| 35.2 | decode burst | lend | r1 | both | decode running 7 >= 6 |" in text
    assert "`slo.ttft_ms=5000`" in text and "`slo.tpot_ms=100`" in text
    assert "| (b) the same while another process prefills 400-token prompts back to back | 100.0 ms (+25%) |" in text
    assert "| the machine's busy cores (all processes, /proc/stat) during (a) / (b) | 1.02 / 1.98 |" in text
    assert "Not a clean measurement" not in text  # the reading of a clean floor is the page's own
    assert (out / "elastic.png").stat().st_size > 0

    summary = json.loads((out / "elastic.json").read_text())
    assert summary["slo_s"]["burst"] == {"ttft": pytest.approx(1.0), "tpot": pytest.approx(0.1)}
    assert summary["results"]["static"]["overall"]["failed"] == 1
    assert summary["decisions"][0]["action"] == "lend"
    assert summary["floor"]["decode_step_with_prefill_ms"] == 100.0


def test_report_without_an_md_starts_from_the_template(tmp_path):
    raw = tmp_path / "raw"
    save_raw(raw, "trace", {"seed": 0, "command": "", "phases": _phases()})
    write_report(load_raw(raw), tmp_path)
    text = (tmp_path / "elastic.md").read_text()
    assert text.index(BEGIN) < text.index(END) < text.index("## Reading the results")
    assert "| prompt-heavy 1 | 0-30 | n/a | 380-440 | 24-40 | 0.45 | n/a | n/a |" in text


def test_floor_with_a_stranger_on_the_machine_says_so():
    text = "\n".join(floor_lines({**_floor(), "busy_cores_idle": 1.6}))
    assert "**Not a clean measurement**: 1.60 cores were busy during (a)" in text


def test_trace_phases_and_classes():
    phases = make_phases(20.0)
    assert [(p.start_s, p.end_s, p.kind) for p in phases] == [(0, 20, "prompt"), (20, 40, "burst"), (40, 60, "prompt")]
    trace = make_trace(tokenizer(), phases, seed=1)
    assert trace == sorted(trace, key=lambda item: item[1]) and trace[0][2].prompt
    for index, arrival, request in trace:
        phase = phases[index]
        assert phase.start_s <= arrival < phase.end_s and len(request.prompt) == request.prompt_tokens
        assert phase.prompt_tokens[0] <= request.prompt_tokens <= phase.prompt_tokens[1]
        assert phase.output_tokens[0] <= request.max_tokens <= phase.output_tokens[1]
    classes = by_class(trace, phases)
    assert list(classes) == ["prompt", "burst"] and sum(map(len, classes.values())) == len(trace)


def test_the_elastic_system_gets_the_slos_and_the_options_are_checked(tmp_path):
    (tmp_path / "trace.jsonl").write_text("stale\n")
    args = system_args("elastic", CALIBRATION, tmp_path / "trace.jsonl")
    assert (args["slo.ttft_ms"], args["slo.tpot_ms"]) == ("5000.0", "100.0")
    assert args["autoscaling.record"] == str(tmp_path.resolve() / "trace.jsonl")
    assert not (tmp_path / "trace.jsonl").exists()  # the last run's record is not appended to
    assert "slo.ttft_ms" not in system_args("static", CALIBRATION, tmp_path / "trace.jsonl")
    options = parse_options(["--systems", "static,elastic", "--stage", "report"])
    assert options.systems == ("static", "elastic") and options.out.name == "benchmarks"
    for bad in (["--systems", "nope"], ["--floor-steps", "1"]):
        with pytest.raises(SystemExit):
            parse_options(bad)


def test_each_system_is_calibrated_on_the_idle_colocated_system_first(monkeypatch):
    started = []

    class FakeServer:
        url = "http://fake"

        def __init__(self, application: str, args: dict, index: int) -> None:
            started.append((application, args.get("slo.ttft_ms"), index))

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def model(self) -> str:
            return "m"

    def uncontended(target, request, max_tokens):
        return {"prompt_tokens": request.prompt_tokens, "ttft_s": 1.0, "tpot_s": 0.04}

    monkeypatch.setattr(elastic, "Server", FakeServer)
    monkeypatch.setattr(elastic, "uncontended", uncontended)
    classes = {"prompt": [BenchRequest([1] * 4, 4, 2)]}
    ran = [
        (system, calibration.slo("prompt"))
        for system, _, calibration in each_system(["colocated", "elastic"], None, classes)
    ]
    assert ran == [("colocated", SLO_PROMPT), ("elastic", SLO_PROMPT)]
    assert started == [("colocated", None, 0), ("disagg", "5000.0", 1)]  # calibrated on the colocated run's server
    started.clear()
    assert [system for system, _, _ in each_system(["static"], None, classes)] == ["static"]
    assert started == [("colocated", None, 0), ("disagg", None, 1)]  # a server of its own to calibrate on
    started.clear()
    assert [system for system, _, _ in each_system(["elastic"], CALIBRATION, classes)] == ["elastic"]
    assert started == [("disagg", "5000.0", 0)]
