"""bench.compare's report: goodput ratios with their bounds, and a regenerated report that
keeps the hand-written text around the generated block."""

from __future__ import annotations

from bench.compare import BEGIN, END, load_previous, ratio_text, write_report
from bench.slo import SLO


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
    calibration = {"summarization": {"prompt_tokens": 400, "ttft_s": 1.2, "tpot_s": 0.05, "rates": [0.1, 0.2]}}
    checks = [
        {
            "prompt_tokens": 400,
            "max_tokens": 30,
            "harness_ttft_s": 1.2,
            "openai_ttft_s": 1.21,
            "harness_e2e_s": 2.6,
            "openai_e2e_s": 2.61,
        }
    ]
    slos = {"summarization": SLO(6.0, 0.1)}
    write_report(tmp_path, tmp_path / "raw", results, calibration, slos, checks, "python -m bench.compare", 600, "m")
    text = (tmp_path / "goodput.md").read_text()
    assert text.startswith("# Title\n\nBefore.\n\n") and text.endswith("\n\nAnalysis after.\n")
    assert "old table" not in text
    assert "| disagg-pull | 0.25 | 2.50x | 95% / 95% |" in text
    assert "| summarization | 1.200 s (400 tok) | 50 ms | 6.000 s | 100 ms | 0.1, 0.2 |" in text
    assert "prefill_queue 0.250 (at 0.2/s)" in text
    for name in ("goodput.png", "goodput_cdf_summarization.png", "goodput.json", "raw/goodput_full.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_merge_keeps_the_other_workloads(tmp_path):
    results = {"summarization": {"colocated": _sweep(0.1, "exact")}, "code": {"colocated": _sweep(0.5, "exact")}}
    calibration = {
        w: {"prompt_tokens": 100, "ttft_s": 0.5, "tpot_s": 0.05, "rates": [0.1, 0.2]} for w in ("summarization", "code")
    }
    slos = {"summarization": SLO(6.0, 0.1), "code": SLO(2.5, 0.1)}
    write_report(tmp_path, tmp_path / "raw", results, calibration, slos, [], "python -m bench.compare", 60, "m")
    previous = load_previous(tmp_path, tmp_path / "raw", skip=["code"])
    assert list(previous["results"]) == ["summarization"] and previous["slos"]["summarization"] == SLO(6.0, 0.1)
    assert previous["results"]["summarization"]["colocated"]["goodput"]["rate"] == 0.1
    assert previous["command"] == "python -m bench.compare" and previous["elapsed_s"] == 60
