"""A GPU replica's cost: the device's roofline, and the host's time to drive each layer.

An eager engine is bound by the host at decode: it launches every layer's kernels from Python
one after another, and the GPU waits (docs/benchmarks/gpu.md: the first run's decode steps took
many times their weights' streaming time, whatever the batch). So a step takes the longer of
the device's time (``planner.roofline.RooflineCost``, its fixed per-step overhead left out:
the host term replaces it) and the host's, which grows with the layers:

* decode: ``layers x (decode_layer_s + decode_layer_row_s x batch)``;
* prefill: ``layers x prefill_layer_s`` (one sequence's launches; no per-token term: the
  kernels are the same whatever the prompt's length).

The calibration file (``planner/calibration/<gpu>-<engine>.json``, format ``gpu-host/1``)
holds the measured steps (``rows``: model shape, kind, batch or prompt tokens, context, step
seconds), the engine they were measured with (``eager``: every step launched from Python;
``graphs``: decode replayed from CUDA graphs of the model's forward; ``fused``: from graphs on
the fused kernels of ``engine.fused_decode``, the default on a GPU), and
the host terms fitted from them (``host``). A row counts for the host fit only when it took at
least ``HOST_BOUND`` x the device's time: a slower row that is not that far above the device
says more about the roofline's efficiencies than about the host. ``python -m planner.gpu_cost
docs/benchmarks/gpu_engine.json --gpu h200 --engine fused`` writes the file from
``bench.gpu_engine``'s rows (``h200-eager``: from ``gpu_engine_eager.json``, the first run).

``HostBoundCost(..., host=None, device_factor=1.2)``: an engine at 1.2x the roofline with no
host term, what a CUDA-graph engine near the memory floor reaches.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner.costs import CALIBRATION_DIR
from planner.roofline import MODELS_DIR, Efficiency, Hardware, ModelShape, RooflineCost, load_hardware, model_shape

FORMAT = "gpu-host/1"
HOST_BOUND = 1.5  # a row this many times the device's time is the host's
NO_OVERHEAD = Efficiency(step_overhead_s=0.0)  # the host term stands for the per-step overhead
ROW_NAME = re.compile(r"^(?P<model>\S+) (?P<kind>decode|prefill) (?:batch (?P<batch>\d+)|(?P<tokens>\d+) tokens)")
CONTEXT = re.compile(r"ctx (\d+)-(\d+)")


@dataclass(frozen=True)
class HostCost:
    """Seconds the host spends per layer of one step (see the module docstring)."""

    decode_layer_s: float
    decode_layer_row_s: float
    prefill_layer_s: float | None  # None: no host-bound prefill row was measured (the device's time alone)

    def decode_s(self, layers: int, batch: int) -> float:
        return layers * (self.decode_layer_s + self.decode_layer_row_s * batch)

    def prefill_s(self, layers: int) -> float:
        return 0.0 if self.prefill_layer_s is None else layers * self.prefill_layer_s


@dataclass(frozen=True)
class StepRow:
    """One measured step: a decode of ``batch`` rows over ``context_tokens`` of KV in all, or a
    prefill of ``batch`` prompt tokens."""

    model: str  # a shape in planner/models/ (or the name the row came with)
    kind: str  # decode | prefill
    batch: int
    context_tokens: int
    step_s: float


@dataclass(frozen=True)
class HostBoundCost:
    """``planner.costs.CostModel``: each step the longer of the device's and the host's time."""

    device: RooflineCost
    host: HostCost | None = None
    device_factor: float = 1.0

    def prefill_s(self, batch_tokens: int) -> float:
        device = self.device.prefill_s(batch_tokens) * self.device_factor
        return max(device, self.host.prefill_s(self.device.shape.num_layers)) if self.host else device

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        device = self.device.decode_step_s(batch_size, context_tokens) * self.device_factor
        return max(device, self.host.decode_s(self.device.shape.num_layers, batch_size)) if self.host else device

    def transfer_s(self, num_bytes: int) -> float:
        return self.device.transfer_s(num_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.device.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return self.device.kv_capacity_tokens


def device_cost(shape: ModelShape, hardware: Hardware, tp: int = 1) -> RooflineCost:
    return RooflineCost(shape, hardware, tp, NO_OVERHEAD)


def device_s(row: StepRow, hardware: Hardware) -> float:
    cost = device_cost(model_shape(row.model), hardware)
    return cost.prefill_s(row.batch) if row.kind == "prefill" else cost.decode_step_s(row.batch, row.context_tokens)


def fit_host(rows: list[StepRow], hardware: Hardware) -> HostCost:
    """The host terms from the host-bound rows: least squares of seconds per layer on the batch
    for decode (one row or one batch size: no per-row term; none: no decode host term, the
    steps are the device's), the median per layer for prefill."""
    bound = [r for r in rows if r.step_s >= HOST_BOUND * device_s(r, hardware)]
    per_layer = [(r, r.step_s / model_shape(r.model).num_layers) for r in bound]
    decode = [(r.batch, s) for r, s in per_layer if r.kind == "decode"]
    if not decode:
        slope, intercept = 0.0, 0.0
    elif len({b for b, _ in decode}) > 1:
        slope, intercept = np.polyfit([b for b, _ in decode], [s for _, s in decode], 1)
    else:
        slope, intercept = 0.0, float(np.mean([s for _, s in decode]))
    prefill = [s for r, s in per_layer if r.kind == "prefill"]
    return HostCost(float(intercept), max(float(slope), 0.0), float(np.median(prefill)) if prefill else None)


def prediction_errors(fit_on: list[StepRow], predict: list[StepRow], hardware: Hardware) -> list[dict[str, Any]]:
    """Each row of ``predict`` against the host terms fitted on ``fit_on`` (error: predicted / measured - 1)."""
    host = fit_host(fit_on, hardware)
    out = []
    for row in predict:
        cost = HostBoundCost(device_cost(model_shape(row.model), hardware), host)
        predicted = (
            cost.prefill_s(row.batch) if row.kind == "prefill" else cost.decode_step_s(row.batch, row.context_tokens)
        )
        out.append(asdict(row) | {"predicted_s": predicted, "error": predicted / row.step_s - 1})
    return out


@dataclass(frozen=True)
class GpuCalibration:
    """A ``gpu-host/1`` file: where it was measured, the rows, and the host terms fitted from them."""

    hardware: str
    engine: str
    source: str
    rows: tuple[StepRow, ...]
    host: HostCost
    cross_check: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def cost(self, shape: ModelShape, hardware: Hardware, tp: int = 1) -> HostBoundCost:
        """This engine on ``hardware`` (the host terms are the host's: they carry to another GPU)."""
        return HostBoundCost(device_cost(shape, hardware, tp), self.host)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self) | {"format": FORMAT}
        return data | {"rows": [asdict(r) for r in self.rows], "host": asdict(self.host)}


def calibration(rows: list[StepRow], hardware: str, engine: str, source: str) -> GpuCalibration:
    """Fit on every row; cross-check each model against the host terms fitted on the others."""
    sheet = load_hardware(hardware)
    models = sorted({r.model for r in rows})
    checks = {
        f"fit on {', '.join(m for m in models if m != model)}, predict {model}": prediction_errors(
            [r for r in rows if r.model != model], [r for r in rows if r.model == model], sheet
        )
        for model in models
        if len(models) > 1
    }
    return GpuCalibration(sheet.name, engine, source, tuple(rows), fit_host(rows, sheet), checks)


def load_gpu_calibration(path: str | Path) -> GpuCalibration:
    path = Path(path)
    if not path.exists() and (CALIBRATION_DIR / f"{path}.json").exists():
        path = CALIBRATION_DIR / f"{path}.json"
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    rows = tuple(StepRow(**row) for row in data["rows"])
    host = HostCost(**data["host"])
    return GpuCalibration(data["hardware"], data["engine"], data["source"], rows, host, data.get("cross_check", {}))


def rows_from_gpu_engine(data: dict[str, Any], engine: str = "eager") -> list[StepRow]:
    """``bench.gpu_engine``'s decode and prefill rows of ``engine`` (decode rows named ``..., CUDA
    graphs, fused kernels`` are the ``fused`` engine, ``..., CUDA graphs`` ``graphs``, the others
    ``eager``, but for the comparisons with synchronous steps or cuBLASLt; prefill runs eagerly in both, so its
    rows count for either); models by their shapes' names."""
    rows = []
    for row in data["rows"]:
        match = ROW_NAME.match(row["name"])
        if match is None or row.get("error") or row.get("time_ms") is None:
            continue
        name = row["name"].lower()
        if "synchronous" in name or "cublaslt" in name:
            continue  # the benchmark's comparisons against the engine as shipped
        decode_engine = "fused" if "fused" in name else "graphs" if "graph" in name else "eager"
        if match["kind"] == "decode" and decode_engine != engine:
            continue
        model = match["model"].lower()
        if not (MODELS_DIR / f"{model}.json").exists():
            continue
        if match["kind"] == "decode":
            batch = int(match["batch"])
            low, high = map(int, CONTEXT.search(row.get("notes", "")).groups())
            rows.append(StepRow(model, "decode", batch, batch * (low + high) // 2, row["time_ms"] / 1e3))
        else:
            rows.append(StepRow(model, "prefill", int(match["tokens"]), 0, row["time_ms"] / 1e3))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.gpu_cost", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="bench.gpu_engine's JSON (docs/benchmarks/gpu_engine.json)")
    parser.add_argument("--gpu", required=True, help="the GPU it was measured on (a planner/hardware name)")
    parser.add_argument("--engine", default="eager", choices=("eager", "graphs", "fused"))
    parser.add_argument("--out", type=Path, help="default planner/calibration/<gpu>-<engine>.json")
    args = parser.parse_args(argv)
    rows = rows_from_gpu_engine(json.loads(args.source.read_text()), args.engine)
    if not rows:
        print(f"error: {args.source}: no {args.engine} decode or prefill row of a shipped model shape", file=sys.stderr)
        return 2
    result = calibration(rows, args.gpu, args.engine, str(args.source))
    out = args.out or CALIBRATION_DIR / f"{result.hardware}-{args.engine}.json"
    out.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    print(f"wrote {out}: host {result.host}")
    for name, check in result.cross_check.items():
        print(name + ": " + ", ".join(f"{r['kind']} {r['batch']}: {r['error']:+.1%}" for r in check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
