"""``bench.calibrate_planner.fit_stack``: the serving stack's fields from recorded probes."""

from __future__ import annotations

import pytest

from bench.calibrate_planner import fit_stack


def _probe(engine_ttft: float, engine_step: float, served_ttft: float, served_tpot: float) -> dict:
    return {
        "ttft_s": served_ttft,
        "tpot_s": served_tpot,
        "ttft_extra_s": served_ttft - engine_ttft,
        "tpot_extra_s": served_tpot - engine_step,
    }


def test_hops_and_factors_are_recovered_from_exact_probes() -> None:
    probes = [_probe(e, 0.05, 0.1 + 1.3 * e, 1.2 * 0.05) for e in (0.1, 0.3, 0.6)]
    fitted = fit_stack({"probes": probes, "load": {"cpu_s_per_token": 0.004}})
    assert fitted["ttft_s"] == pytest.approx(0.1, abs=1e-5)
    assert fitted["prefill_factor"] == pytest.approx(1.3, abs=1e-4)
    assert fitted["decode_factor"] == pytest.approx(1.2, abs=1e-4)
    assert fitted["cpu_s_per_token"] == 0.004


def test_a_served_app_faster_than_the_engine_is_taken_as_factor_one() -> None:
    """Noise (a drift between the engine's calibration and the probes) never makes the served
    engine faster than the bare one: factor 1, the hops the median excess, never below 0."""
    probes = [_probe(e, 0.05, 0.05 + 0.9 * e, 0.045) for e in (0.1, 0.3, 0.6)]
    fitted = fit_stack({"probes": probes, "load": {"cpu_s_per_token": 0.0}})
    assert fitted["prefill_factor"] == 1.0 and fitted["decode_factor"] == 1.0
    assert fitted["ttft_s"] == pytest.approx(0.02, abs=1e-5)  # median of 0.04, 0.02, -0.01


def test_batched_probes_give_a_decode_factor_per_batch() -> None:
    """2 requests at once decoded at 0.07 s a token where the engine's batch-2 step is 0.0625 s,
    4 at 0.09 s against 0.075 s: x1.12 and x1.2 beside the batch-1 factor; none without probes."""
    probes = [_probe(e, 0.05, 0.1 + 1.3 * e, 1.3 * 0.05) for e in (0.1, 0.3, 0.6)]
    kind = {"probes": probes, "load": {"cpu_s_per_token": 0.0}}
    assert "batched_decode_factors" not in fit_stack(kind)
    kind["batched"] = [
        {"batch": 4, "prompt_tokens": 200, "tpot_s": 0.09, "engine_step_s": 0.075},
        {"batch": 2, "prompt_tokens": 200, "tpot_s": 0.07, "engine_step_s": 0.0625},
    ]
    fitted = fit_stack(kind)
    assert fitted["batched_decode_factors"] == [[2, 1.12], [4, 1.2]]
    assert fitted["decode_factor"] == pytest.approx(1.3, abs=1e-4)
    kind["batched"][0]["tpot_s"] = 0.07  # faster than the bare engine: noise, factor 1
    assert fit_stack(kind)["batched_decode_factors"] == [[2, 1.12], [4, 1.0]]
