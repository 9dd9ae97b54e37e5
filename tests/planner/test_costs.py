"""The cost model's math: fits on exact data, on the recorded calibration file, the transfer formula."""

from __future__ import annotations

import json
import statistics

import pytest

from planner.costs import (
    DEFAULT_CALIBRATION,
    CalibratedCost,
    CostModel,
    LinearFit,
    PiecewiseLinear,
    calibrated_cost,
    load_calibration,
    save_calibration,
)


def _document() -> dict:
    """A calibration of known costs: prefill 10 ms + 3 ms a token, decode step 40 ms + 2 ms a
    sequence + 1 us a KV token, transfer 1 ms + 1 GB/s."""
    return {
        "engine": {"kv_bytes_per_token": 1000, "kv_capacity_tokens": 8192},
        "prefill": [{"tokens": n, "seconds": 0.01 + 0.003 * n} for n in (16, 64, 256, 512)],
        "decode": [
            {"batch": b, "context_tokens": c, "seconds": 0.04 + 0.002 * b + 1e-6 * c}
            for b in (1, 2, 4, 8)
            for c in (100 * b, 400 * b)
        ],
        "transfer": [{"bytes": n, "seconds": 0.001 + n / 1e9} for n in (1 << 20, 16 << 20, 64 << 20)],
        "interference": {"value": 0.08},
    }


def test_exact_fits_recover_the_costs() -> None:
    cost = calibrated_cost(_document())
    assert isinstance(cost, CostModel)
    assert cost.prefill_s(100) == pytest.approx(0.31)
    assert cost.prefill_s(1024) == pytest.approx(0.01 + 0.003 * 1024)  # past the last point: last slope
    assert cost.prefill_s(0) == 0.0
    assert cost.decode_step_s(3, 900) == pytest.approx(0.04 + 0.006 + 0.0009)
    assert cost.decode_step_s(0, 0) == 0.0
    assert cost.decode.intercept == pytest.approx(0.04) and cost.decode.coefs == pytest.approx(
        (0.002, 1e-6, 0.0), abs=1e-9
    )
    assert cost.interference == 0.08
    assert cost.kv_bytes_per_token == 1000 and cost.kv_capacity_tokens == 8192


def test_transfer_is_per_transfer_cost_plus_bytes_over_bandwidth() -> None:
    cost = calibrated_cost(_document())
    assert cost.transfer.intercept == pytest.approx(0.001)
    assert cost.transfer_bytes_per_s == pytest.approx(1e9)
    for num_bytes in (0, 1000, 10**8):
        assert cost.transfer_s(num_bytes) == pytest.approx(0.001 + num_bytes / 1e9)


def test_a_negative_coefficient_is_dropped_not_kept() -> None:
    """Noise that makes more context look cheaper gives c = 0, and the rest is refitted."""
    fit = LinearFit.fit([(1, 100), (2, 50), (4, 10), (8, 5)], [0.042, 0.044, 0.048, 0.056])
    assert fit.coefs[1] == 0.0
    assert fit.coefs[0] == pytest.approx(0.002) and fit.intercept == pytest.approx(0.04)


def test_piecewise_linear_takes_medians_and_never_decreases() -> None:
    curve = PiecewiseLinear.through([(10, 1.0), (10, 3.0), (10, 2.0), (20, 1.5), (30, 4.0)])
    assert curve.xs == (10, 20, 30)
    assert curve.ys == (2.0, 2.0, 4.0)  # median 2.0 at 10; 1.5 at 20 lifted to 2.0
    assert curve(25) == pytest.approx(3.0)
    assert curve(40) == pytest.approx(6.0)


def test_kv_pool_size_changes_only_the_capacity() -> None:
    cost = calibrated_cost(_document())
    bigger = cost.with_kv_cache_bytes(1000 * 16 * 100 + 999)
    assert bigger.kv_capacity_tokens == 1600  # whole blocks of 16 tokens
    assert bigger.decode_step_s(2, 50) == cost.decode_step_s(2, 50)


def test_save_and_load_round_trip(tmp_path) -> None:
    path = save_calibration(_document(), tmp_path / "cal.json")
    assert json.loads(path.read_text())["engine"]["kv_capacity_tokens"] == 8192
    assert load_calibration(path).decode_step_s(1, 0) == pytest.approx(0.042)


def test_the_recorded_calibration_fits_its_own_points() -> None:
    """planner/calibration/cpu-2core.json (measured with bench.calibrate_planner): prefill passes
    through every token count's median (drift aside), the decode fit is within 20% of each
    (batch, context) shape's median over the rounds (10% for the median shape), the transfer
    line within 30% (or 0.5 ms: one sub-millisecond transfer's jitter on this machine) of each
    size's time."""
    cost: CalibratedCost = load_calibration(DEFAULT_CALIBRATION)
    data = cost.raw
    assert {"command", "machine", "prefill", "decode", "transfer", "interference"} <= set(data)
    for point in data["prefill"]:
        assert cost.prefill_s(point["tokens"]) == pytest.approx(point["seconds"], rel=0.15)
    groups: dict[tuple[int, int], list[dict]] = {}
    for point in data["decode"]:
        groups.setdefault((point["batch"], point["context_tokens"]), []).append(point)
    errors = []
    for (batch, context), points in groups.items():
        seconds = statistics.median(p["seconds"] for p in points)
        assert cost.decode_step_s(batch, context) == pytest.approx(seconds, rel=0.2)
        errors.append(abs(cost.decode_step_s(batch, context) / seconds - 1))
    assert statistics.median(errors) < 0.1
    for point in data["transfer"]:
        assert cost.transfer_s(point["bytes"]) == pytest.approx(point["seconds"], rel=0.3, abs=5e-4)
    assert 0.0 <= cost.interference < 1.0
    assert cost.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # the default model: layers x K/V x heads x dim x fp32
