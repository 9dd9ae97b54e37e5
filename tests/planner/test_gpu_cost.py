"""The GPU cost: the roofline plus the host's measured time per layer, fitted from the H200 runs
into planner/calibration/h200-eager.json (the first run, docs/benchmarks/gpu_engine_eager.json)
and h200-fused.json / h200-graphs.json (decode from CUDA graphs, on the fused kernels or of the
model's forward: docs/benchmarks/gpu_engine.json), and checked across model sizes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner.gpu_cost import (
    HostBoundCost,
    HostCost,
    StepRow,
    calibration,
    device_cost,
    device_s,
    fit_host,
    load_gpu_calibration,
    rows_from_gpu_engine,
)
from planner.roofline import load_hardware, model_shape

ROOT = Path(__file__).parents[2]
GPU_ENGINE = json.loads((ROOT / "docs" / "benchmarks" / "gpu_engine_eager.json").read_text())
GPU_ENGINE_GRAPHS = json.loads((ROOT / "docs" / "benchmarks" / "gpu_engine.json").read_text())


def _approx(value: object) -> object:
    """``value`` with every float as ``pytest.approx`` (relative 1e-9), nested containers kept."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-9)
    if isinstance(value, dict):
        return {k: _approx(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_approx(v) for v in value]
    return value


def test_the_shipped_calibration_is_what_the_h200_rows_give():
    shipped = load_gpu_calibration("h200-eager")
    rows = rows_from_gpu_engine(GPU_ENGINE)
    assert [(r.model, r.kind, r.batch) for r in rows] == [
        ("llama-1b", "decode", 1), ("llama-1b", "decode", 64), ("llama-1b", "prefill", 2048),
        ("llama-8b", "decode", 1), ("llama-8b", "decode", 64), ("llama-8b", "prefill", 2048),
    ]  # fmt: skip
    assert rows[1].context_tokens == 64 * 160 and rows[0].step_s == pytest.approx(0.022756, rel=1e-4)
    refit = calibration(rows, "h200", "eager", "docs/benchmarks/gpu_engine_eager.json")
    # equal up to the last bits of a least-squares fit, which differ between CPUs' BLAS kernels
    assert _approx(refit.to_json()) == json.loads((ROOT / "planner" / "calibration" / "h200-eager.json").read_text())
    assert _approx(vars(shipped.host)) == vars(refit.host)
    assert 1.4e-3 < shipped.host.decode_layer_s < 1.6e-3  # "about 1.4-1.6 ms of host cost per layer-step"


@pytest.mark.parametrize("engine", ["fused", "graphs"])
def test_the_shipped_graph_calibrations_are_what_their_rows_give(engine):
    """Decode rows replayed from CUDA graphs on the fused kernels (``fused``, the engine as it ships
    on a GPU) or of the model's forward (``graphs``), one run; the prefill rows (eager in both)."""
    rows = rows_from_gpu_engine(GPU_ENGINE_GRAPHS, engine)
    assert [(r.model, r.kind, r.batch, r.context_tokens) for r in rows] == [
        ("llama-1b", "decode", 1, 160), ("llama-1b", "decode", 64, 64 * 160), ("llama-1b", "decode", 1, 4000),
        ("llama-1b", "prefill", 2048, 0),
        ("llama-8b", "decode", 1, 160), ("llama-8b", "decode", 64, 64 * 160), ("llama-8b", "decode", 1, 4000),
        ("llama-8b", "prefill", 2048, 0),
    ]  # fmt: skip
    refit = calibration(rows, "h200", engine, "docs/benchmarks/gpu_engine.json")
    shipped = json.loads((ROOT / "planner" / "calibration" / f"h200-{engine}.json").read_text())
    assert _approx(refit.to_json()) == shipped
    # graphs take the per-layer cost from about 1.5 ms to about 0.2 ms, the fused kernels to under 0.1 ms
    assert load_gpu_calibration(f"h200-{engine}").host.decode_layer_s < {"graphs": 0.25e-3, "fused": 0.1e-3}[engine]


def test_one_model_predicts_the_other_within_the_errors_the_calibration_reports():
    """Fitted on the 1B-class rows, the 8B-class decode steps come 8% and 21% under; the 8B's
    prefill is the device's (no host-bound row), 14% under. The reverse over-predicts the 1B's
    decode by 9% and 27%, and misses its host-bound prefill by 48% (no prefill host term)."""
    shipped = load_gpu_calibration("h200-eager")
    errors = {name: [round(r["error"], 3) for r in rows] for name, rows in shipped.cross_check.items()}
    assert errors == {
        "fit on llama-1b, predict llama-8b": [-0.082, -0.213, -0.144],
        "fit on llama-8b, predict llama-1b": [0.089, 0.27, -0.482],
    }


def test_a_step_takes_the_longer_of_the_device_and_the_host():
    shape, h100 = model_shape("llama-8b"), load_hardware("h100")
    device = device_cost(shape, h100)
    host = HostCost(decode_layer_s=1e-3, decode_layer_row_s=1e-5, prefill_layer_s=5e-4)
    cost = HostBoundCost(device, host)
    assert cost.decode_step_s(4, 4000) == pytest.approx(max(device.decode_step_s(4, 4000), 32 * (1e-3 + 4e-5)))
    assert cost.decode_step_s(0, 0) == 0.0
    assert cost.prefill_s(8192) == pytest.approx(device.prefill_s(8192))  # compute-bound: the device's
    assert cost.prefill_s(16) == pytest.approx(32 * 5e-4)  # a short prompt: the host's launches
    faster = HostBoundCost(device, None, 1.2)
    assert faster.decode_step_s(1, 100) == pytest.approx(1.2 * device.decode_step_s(1, 100))
    assert faster.kv_capacity_tokens == device.kv_capacity_tokens and faster.transfer_s(10) == device.transfer_s(10)


def test_graph_rows_are_another_engine_and_unknown_shapes_are_left_out():
    data = {"rows": [
        {"name": "llama-1B decode batch 1", "time_ms": 20.0, "notes": "ctx 100-200"},
        {"name": "llama-1B decode batch 1, CUDA graphs", "time_ms": 2.0, "notes": "ctx 100-200"},
        {"name": "llama-70B decode batch 1", "time_ms": 90.0, "notes": "ctx 100-200"},
        {"name": "llama-1B prefill 512 tokens", "time_ms": None, "error": "OOM"},
    ]}  # fmt: skip
    assert rows_from_gpu_engine(data) == [StepRow("llama-1b", "decode", 1, 150, 0.02)]
    assert rows_from_gpu_engine(data, "graphs") == [StepRow("llama-1b", "decode", 1, 150, 0.002)]


def test_rows_at_the_devices_time_fit_no_decode_host_term():
    """The fused engine's 8B-class decode steps are within 1.5x of the roofline: nothing of them
    is the host's, so a fit on them alone has no decode host term and predicts the device's time."""
    h200 = load_hardware("h200")
    at_device = StepRow("llama-8b", "decode", 1, 160, 0.0)
    at_device = dataclasses.replace(at_device, step_s=1.2 * device_s(at_device, h200))
    assert fit_host([at_device], h200) == HostCost(0.0, 0.0, None)
