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
