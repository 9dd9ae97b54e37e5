"""Cost models: seconds for each phase of one replica, the simulator's only view of hardware.

``CostModel`` is the contract the simulator (``planner.simulator``) and the planner rely on;
two sources implement it: ``CalibratedCost`` (this file), fitted to points measured with the
real engine (``python -m bench.calibrate_planner`` writes the file), and
``planner.roofline.RooflineCost``, derived from a model config and a hardware sheet.

The fits, and why each has its shape:

* prefill: piecewise-linear through the measured (prompt tokens, seconds) points (median per
  token count), extended past the last point with the last segment's slope and below the first
  along the first segment's line. Attention makes prefill slightly super-linear; a
  piecewise-linear curve follows that without choosing a degree.
* decode step: least squares ``a + b * batch + c * context_tokens + d * [batch >= 2]``
  (``context_tokens`` is the sum of the batch's KV lengths): the weights are read once a step
  (``a``), each sequence adds its rows of every product and its sampling (``b``), each KV token
  is read once (``c``); ``d`` is the step the CPU engine takes from one row to two, where its
  products switch from matrix-vector kernels to oneDNN's packed weights (``engine/cpu_matmul.py``).
* KV transfer: least squares ``per_transfer_s + bytes / bytes_per_s``.
* serving stack (``ServingStack``, per system kind, measured through the served app): what the
  served replica, the HTTP proxy, the ingress, Serve's token streaming and the client add to
  the engine's own costs. One request at a time on the idle app, TTFT = ``ttft_s`` +
  ``prefill_factor`` x the engine's prefill (and transfer), fitted over three prompt lengths,
  and TPOT = ``decode_factor`` x the engine's batch-1 step (``batched_decode_factors`` at
  batches 2 and 4, from as many requests sent at once, linear between): a served replica computes slower
  than the bare engine (its process also runs Serve's event loop, Ray's core worker, the
  transport's progress thread and the metrics, on the same core), and the hops add a fixed
  time in front of the first token. Under load, ``cpu_s_per_token`` is the CPU every process
  but the engine replicas spends per streamed token, and ``cores`` the cores they all share:
  the simulator slows every step by ``(busy replicas + that CPU demand) / cores`` when above 1
  (processor sharing). None of it applies on GPUs, where the stack runs on host cores the
  engines do not compute on.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

CALIBRATION_DIR = Path(__file__).parent / "calibration"
DEFAULT_CALIBRATION = CALIBRATION_DIR / "cpu-2core.json"


@runtime_checkable
class CostModel(Protocol):
    """Seconds for each phase of ONE replica (already including its tensor-parallel degree).

    Every method is pure and cheap (the simulator calls them once per engine step) and
    returns seconds >= 0; larger inputs never give a smaller time."""

    def prefill_s(self, batch_tokens: int) -> float:
        """One prefill forward over ``batch_tokens`` prompt tokens (the sum of the batch)."""
        ...

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of ``batch_size`` sequences whose KV lengths sum to ``context_tokens``."""
        ...

    def transfer_s(self, num_bytes: int) -> float:
        """One KV transfer between replicas: per-transfer cost + bytes / bandwidth."""
        ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens one replica can hold."""
        ...


@dataclass(frozen=True)
class LinearFit:
    """``intercept + sum(coef_i * x_i)``, fitted by least squares (coefficients kept >= 0)."""

    intercept: float
    coefs: tuple[float, ...]

    def __call__(self, *xs: float) -> float:
        total = self.intercept
        for coef, x in zip(self.coefs, xs):
            total += coef * x
        return total

    @classmethod
    def fit(cls, xs: Sequence[Sequence[float]], ys: Sequence[float]) -> LinearFit:
        """Least squares; a coefficient that comes out negative (noise on a flat input) is
        dropped to 0 and the rest refitted, so the model never predicts less for more work."""
        x = np.asarray(xs, dtype=float).reshape(len(ys), -1)
        y = np.asarray(ys, dtype=float)
        keep = list(range(x.shape[1]))
        while True:
            design = np.column_stack([np.ones(len(y)), x[:, keep]])
            solution, *_ = np.linalg.lstsq(design, y, rcond=None)
            negative = [k for k, c in zip(keep, solution[1:]) if c < 0]
            if not negative:
                break
            keep.remove(negative[0])
        coefs = [0.0] * x.shape[1]
        for k, c in zip(keep, solution[1:]):
            coefs[k] = float(c)
        return cls(max(float(solution[0]), 0.0), tuple(coefs))


@dataclass(frozen=True)
class PiecewiseLinear:
    """Straight lines between sorted ``(x, y)`` knots, extended past both ends."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * x / xs[0] if xs[0] else ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(ys[i] + slope * (x - xs[i]), 0.0)

    @classmethod
    def through(cls, points: Sequence[Sequence[float]]) -> PiecewiseLinear:
        """Knots at the median y of each distinct x, made non-decreasing (drift between
        repetitions must not make a longer prompt look cheaper)."""
        by_x: dict[float, list[float]] = {}
        for x, y in points:
            by_x.setdefault(float(x), []).append(float(y))
        xs = sorted(by_x)
        ys = [float(np.median(by_x[x])) for x in xs]
        for i in range(1, len(ys)):
            ys[i] = max(ys[i], ys[i - 1])
        return cls(tuple(xs), tuple(ys))


@dataclass(frozen=True)
class ServingStack:
    """The serving stack's share of a request's latency (module docstring): a fixed time in
    front of every first token, the served engine's slowdown per phase, and the CPU the
    processes around the engines take from the shared cores under load."""

    ttft_s: float = 0.0
    prefill_factor: float = 1.0
    decode_factor: float = 1.0
    cpu_s_per_token: float = 0.0  # CPU of the processes around the engines, per streamed token
    cores: int = 0  # cores the engines and the stack share (0: not shared)
    batched_decode_factors: tuple[tuple[int, float], ...] = ()  # (batch >= 2, factor), by batch

    def decode_factor_at(self, batch: int) -> float:
        """The served engine's slowdown on a decode step of ``batch`` sequences: linear between
        the batches probed (``decode_factor`` at 1), the last one's beyond them."""
        if batch <= 1 or not self.batched_decode_factors:
            return self.decode_factor
        below = (1, self.decode_factor)
        for above in self.batched_decode_factors:
            if batch <= above[0]:
                return below[1] + (above[1] - below[1]) * (batch - below[0]) / (above[0] - below[0])
            below = above
        return below[1]

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> ServingStack:
        if not data:
            return cls()
        return cls(
            float(data["ttft_s"]),
            float(data.get("prefill_factor", 1.0)),
            float(data.get("decode_factor", 1.0)),
            float(data.get("cpu_s_per_token", 0.0)),
            int(data.get("cores", 0)),
            tuple((int(b), float(f)) for b, f in data.get("batched_decode_factors", ())),
        )


NO_STACK = ServingStack()


@dataclass(frozen=True)
class CalibratedCost:
    """A ``CostModel`` fitted to a recorded calibration (one replica of the served engine).

    ``prefill`` maps prompt tokens to seconds, ``decode`` is ``a + b * batch + c * context +
    d * [batch >= 2]``,
    ``transfer`` is ``per_transfer_s + bytes * s_per_byte``. ``raw`` keeps the whole file."""

    prefill: PiecewiseLinear
    decode: LinearFit
    transfer: LinearFit
    kv_bytes_per_token_: int
    kv_capacity_tokens_: int
    interference: float = 0.0  # measured slowdown of one replica's step while another computes
    stacks: dict[str, ServingStack] = field(default_factory=dict, compare=False)  # per system kind
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def prefill_s(self, batch_tokens: int) -> float:
        return self.prefill(batch_tokens) if batch_tokens > 0 else 0.0

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        a, b, c, d = self._decode_coefficients
        return a + b * batch_size + c * context_tokens + (d if batch_size >= 2 else 0.0)

    @cached_property
    def _decode_coefficients(self) -> tuple[float, float, float, float]:
        """``self.decode``'s numbers, unpacked once: the simulator calls this every step."""
        return (self.decode.intercept, *self.decode.coefs)

    def transfer_s(self, num_bytes: int) -> float:
        return self.transfer(num_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_tokens_

    @property
    def transfer_bytes_per_s(self) -> float:
        return 1.0 / self.transfer.coefs[0] if self.transfer.coefs[0] > 0 else float("inf")

    def stack(self, kind: str) -> ServingStack:
        """The serving stack measured for ``kind`` (``colocated`` / ``disaggregated``); none if not measured."""
        return self.stacks.get(kind, NO_STACK)

    def with_kv_cache_bytes(self, kv_cache_bytes: int, block_size: int = 16) -> CalibratedCost:
        """The same costs with another KV pool size (whole blocks, as the engine sizes it)."""
        bytes_per_block = self.kv_bytes_per_token_ * block_size
        return replace(self, kv_capacity_tokens_=kv_cache_bytes // bytes_per_block * block_size)


def calibrated_cost(data: dict[str, Any]) -> CalibratedCost:
    """Fit the cost model to a calibration document (the JSON ``planner.calibrate`` writes)."""
    prefill = PiecewiseLinear.through([(p["tokens"], p["seconds"]) for p in data["prefill"]])
    decode_points = data["decode"]
    decode = LinearFit.fit(
        [(p["batch"], p["context_tokens"], 1.0 if p["batch"] >= 2 else 0.0) for p in decode_points],
        [p["seconds"] for p in decode_points],
    )
    transfer_points = data["transfer"]
    transfer = LinearFit.fit([(p["bytes"],) for p in transfer_points], [p["seconds"] for p in transfer_points])
    engine = data["engine"]
    return CalibratedCost(
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        kv_bytes_per_token_=int(engine["kv_bytes_per_token"]),
        kv_capacity_tokens_=int(engine["kv_capacity_tokens"]),
        interference=float(data.get("interference", {}).get("value", 0.0)),
        stacks={kind: ServingStack.of(part) for kind, part in data.get("stack", {}).get("kinds", {}).items()},
        raw=data,
    )


def load_calibration(path: str | Path = DEFAULT_CALIBRATION) -> CalibratedCost:
    """The ``CalibratedCost`` of a recorded calibration file."""
    return calibrated_cost(json.loads(Path(path).read_text()))


def save_calibration(data: dict[str, Any], path: str | Path = DEFAULT_CALIBRATION) -> Path:
    """Write a calibration document (checked by fitting it first)."""
    calibrated_cost(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
