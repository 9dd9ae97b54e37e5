"""bench.compare's report: goodput ratios with their bounds, and a regenerated report that
keeps the hand-written text around the generated block."""

from __future__ import annotations

import pytest

from bench.compare import NAME, load_previous, merged, parse_options, ratio_text, workload_slo, write_report
from bench.report import markers
from bench.slo import SLO

BEGIN, END = markers(NAME)


def _sweep(rate: float, bound: str, rates=(0.1, 0.2)) -> dict:
    points = [
        {
            "rate": r,
            "attainment": 0.95,
            "ttft_s": {"p90": 1.0},
            "tpot_s": {"p90": 0.05},
            "server_ttft_split_s": {"prefill_queue": 0.25},
            "records": [
                {
                    "prompt_tokens": 5,
                    "max_tokens": 3,
                    "sent": 0.0,
                    "chunks": [0.1, 0.2, 0.3],
                    "last": 0.3,
                    "usage_prompt_tokens": 5,
                    "usage_output_tokens": 3,
                    "error": None,
                }
            ],
        }
        for r in rates
    ]
    return {"points": points, "goodput": {"rate": rate, "bound": bound, "text": str(rate)}}


def _calibration(prompt_tokens: int, ttft_s: float, tpot_s: float) -> dict:
    return {"prompt_tokens": prompt_tokens, "ttft_s": ttft_s, "tpot_s": tpot_s, "median_output_tokens": 30,
            "e2e_s": ttft_s + 29 * tpot_s, "multipliers": [0.5, 1.0], "rates": [0.1, 0.2]}  # fmt: skip


def _report(command: str, elapsed_s: float, calibration: dict, crosscheck: list, results: dict) -> dict:
    return {"command": command, "elapsed_s": elapsed_s, "model": "m", "calibration": calibration,
            "crosscheck": crosscheck, "results": results}  # fmt: skip


def _check(prompt_tokens: int, max_tokens: int, *times: float) -> dict:
    keys = ("harness_ttft_s", "openai_ttft_s", "harness_e2e_s", "openai_e2e_s")
    return {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, **dict(zip(keys, times))}


def test_ratio_text_states_bounds():
    colocated = _sweep(0.1, "exact")
    assert ratio_text(_sweep(0.25, "exact"), colocated) == "2.50x"
    assert ratio_text(_sweep(0.2, "at_least"), colocated) == ">= 2.00x"
    assert ratio_text(_sweep(0.0, "below"), colocated) == "< 1.00x"
    assert ratio_text(_sweep(0.15, "exact"), _sweep(0.0, "below")) == "> 1.50x"
    assert ratio_text(_sweep(0.0, "below"), _sweep(0.0, "below")) == "n/a (both below the lowest rate)"
    assert ratio_text(_sweep(0.1, "exact"), _sweep(0.2, "at_least")) == "<= 0.50x"
    assert ratio_text(_sweep(0.1, "exact"), None) == "n/a"


def test_report_is_regenerated_between_its_markers(tmp_path):
    (tmp_path / "goodput.md").write_text(f"# Title\n\nBefore.\n\n{BEGIN}\nold table\n{END}\n\nAnalysis after.\n")
    results = {"summarization": {"colocated": _sweep(0.1, "exact"), "disagg-pull": _sweep(0.25, "exact")}}
    check = _check(400, 30, 1.2, 1.21, 2.6, 2.61)
    workloads = {"summarization": _calibration(400, 1.2, 0.05)}
    assert workload_slo(workloads["summarization"]) == SLO(6.0, 0.1)  # TTFT 5x, TPOT 2x the uncontended
    report = _report("python -m bench.compare", 600, workloads, [check], results)
    write_report(report, tmp_path, tmp_path / "raw")
    text = (tmp_path / "goodput.md").read_text()
    assert text.startswith("# Title\n\nBefore.\n\n") and text.endswith("\n\nAnalysis after.\n")
    assert "old table" not in text
    assert "| disagg-pull | 0.25 | 2.50x | 95% / 95% |" in text
    assert "| summarization | 1.200 s (400 tok) | 50 ms | 6.000 s | 100 ms | 0.1, 0.2 |" in text
    assert "prefill_queue 0.250 (at 0.2/s)" in text
    assert "| 400 | 30 | 1.200 | 1.210 | 2.600 | 2.610 |" in text
    for name in ("goodput.png", "goodput_cdf_summarization.png", "goodput.json", "raw/goodput_full.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_merge_keeps_the_other_workloads(tmp_path):
    results = {"summarization": {"colocated": _sweep(0.1, "exact")}, "code": {"colocated": _sweep(0.5, "exact")}}
    calibrations = {"summarization": _calibration(100, 1.2, 0.05), "code": _calibration(50, 0.5, 0.05)}
    report = _report("python -m bench.compare", 60, calibrations, [], results)
    write_report(report, tmp_path, tmp_path / "raw")
    previous = load_previous(tmp_path, tmp_path / "raw", skip=["code"])
    workloads = previous["calibration"]
    assert list(previous["results"]) == ["summarization"] and workload_slo(workloads["summarization"]) == SLO(6.0, 0.1)
    assert workloads == {"summarization": calibrations["summarization"]}  # as written, back from the JSON
    assert previous["results"]["summarization"]["colocated"]["goodput"]["rate"] == 0.1
    assert previous["command"] == "python -m bench.compare" and previous["elapsed_s"] == 60
    assert merged(report, None) is report
    this_run = _report("python -m bench.compare --merge", 30, {"code": calibrations["code"]}, [], {"code": {}})
    both = merged(this_run, previous)
    assert both["command"] == "python -m bench.compare && python -m bench.compare --merge" and both["elapsed_s"] == 90
    assert list(both["calibration"]) == ["summarization", "code"] and list(both["results"]) == ["summarization", "code"]


def test_options_parse_the_lists_and_name_an_unknown_system(capsys):
    options = parse_options(["--workloads", "code,chatbot", "--multipliers", "code=1,2 chatbot=0.5", "--out", "x"])
    assert options.workloads == ("code", "chatbot") and str(options.out) == "x"
    assert options.multipliers["code"] == (1.0, 2.0) and options.multipliers["chatbot"] == (0.5,)
    assert options.multipliers["summarization"] == (0.25, 0.5, 0.75, 1.0, 1.25)
    with pytest.raises(SystemExit):
        parse_options(["--systems", "colocated,disagg"])
    assert "unknown system 'disagg': choose from colocated, colocated-chunked" in capsys.readouterr().err


def test_main_calibrates_once_then_rewrites_the_report_after_every_sweep(tmp_path, monkeypatch):
    """The three stages with the servers and measurements stubbed: calibration on the plain
    colocated system only (started first even when not compared), one sweep per system and
    workload, the report rewritten after each."""
    import bench.compare as compare
    from workloads import BenchRequest

    started, swept, written = [], [], []

    class FakeServer:
        def __init__(self, application, args, index):
            self.application, self.url, self.metrics_url = application, "http://fake", f"http://fake/{index}"
            started.append((application, args.get("transport.mode"), index))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def model(self):
            return "m"

    def fake_sweep(target, requests, rates, slo, seed, metrics_url, label):
        swept.append((label, tuple(rates), metrics_url))
        return _sweep(rates[0], "exact", rates)

    requests = [BenchRequest([1] * 100, 100, 31), BenchRequest([1] * 200, 200, 11), BenchRequest([1] * 300, 300, 21)]
    check = _check(1, 2, 0.1, 0.1, 0.2, 0.2)
    base = {"prompt_tokens": 200, "ttft_s": 0.2, "tpot_s": 0.05}  # of the median request (200 tokens)
    monkeypatch.setattr(compare, "Server", FakeServer)
    monkeypatch.setattr(compare, "workload_requests", lambda options: {w: requests for w in options.workloads})
    monkeypatch.setattr(compare, "uncontended", lambda target, request, max_tokens: base)
    monkeypatch.setattr(compare, "crosscheck", lambda target, requests: [check])
    monkeypatch.setattr(compare, "sweep", fake_sweep)
    monkeypatch.setattr(compare, "write_report", lambda report, out, raw: written.append(report))
    argv = ["--workloads", "code,chatbot", "--systems", "disagg-pull,disagg-push", "--multipliers", "code=1,2"]
    compare.main([*argv, "--out", str(tmp_path), "--raw", str(tmp_path / "raw")])

    assert started == [("colocated", None, 0), ("disagg", "pull", 1), ("disagg", "push", 2)]
    e2e = 0.2 + 20 * 0.05  # median output 21 tokens
    code_rates = (round(2 / e2e, 4), round(4 / e2e, 4))
    assert swept[0] == ("disagg-pull/code", code_rates, "http://fake/1") and len(swept) == 4
    assert [list(r["results"]["code"]) for r in written] == [
        ["disagg-pull"],
        ["disagg-pull"],
        ["disagg-pull", "disagg-push"],
        ["disagg-pull", "disagg-push"],
    ]
    final = written[-1]
    code = final["calibration"]["code"]
    assert workload_slo(code) == SLO(1.0, 0.1) and code["rates"] == list(code_rates) and code["prompt_tokens"] == 200
    assert list(final["calibration"]) == ["code", "chatbot"] and final["crosscheck"] == [check]
    assert final["command"] == "python -m bench.compare " + " ".join(
        argv + ["--out", str(tmp_path), "--raw", str(tmp_path / "raw")]
    )
