"""``bench.planner_check``'s predictions: with the serving stack probed on the app before its
runs, and beside them with the calibration file's stack."""

from __future__ import annotations

from bench.planner_check import add_predictions, render
from planner.costs import DEFAULT_CALIBRATION


def _run(ttft: float, tpot: float) -> dict:
    return {"ttft_s": {"p50": ttft, "p90": 2 * ttft}, "tpot_s": {"p50": tpot, "p90": 1.2 * tpot}}


def _report(stack: dict | None) -> dict:
    system = {"goodput": 0.6, "points": [{"rate": 0.2, "runs": [_run(0.4, 0.07), _run(0.42, 0.072)]}]}
    if stack:
        system["stack"] = stack
    return {
        "command": "python -m bench.planner_check",
        "machine": "test",
        "workload": "chatbot",
        "num_requests": 12,
        "seed": 0,
        "fractions": [0.3],
        "systems": {"colocated": system},
    }


def test_a_probed_stack_drives_the_predictions_and_the_file_stack_is_reported_beside() -> None:
    slow = {"ttft_s": 2.0, "prefill_factor": 1.0, "decode_factor": 3.0, "cpu_s_per_token": 0.0, "cores": 2}
    report = add_predictions(_report(slow), DEFAULT_CALIBRATION)
    (point,) = report["systems"]["colocated"]["points"]
    assert point["predicted"]["ttft_s"]["p50"] > point["predicted_file"]["ttft_s"]["p50"] + 1.5
    assert point["predicted"]["tpot_s"]["p50"] > 2 * point["predicted_file"]["tpot_s"]["p50"]
    assert [r["within"] for r in point["rows"]] == [False] * 4
    text = "\n".join(render(report))
    assert "**0 of 4 predictions within their bound** with the serving stack probed" in text
    assert "Serving stack probed on this app before its runs: TTFT + 2000 ms; prefill x 1.00, decode x 3.00" in text


def test_without_a_probe_the_calibration_file_stack_alone() -> None:
    report = add_predictions(_report(None), DEFAULT_CALIBRATION)
    (point,) = report["systems"]["colocated"]["points"]
    assert "predicted_file" not in point and len(point["rows"]) == 4
    assert "with the calibration file's stack" not in "\n".join(render(report))
