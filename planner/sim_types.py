"""The simulator's inputs and outputs (``planner.simulator.simulate``): the requests, the
system simulated, and what each request measured. Plain frozen data, used by the replica
model (``planner.sim_engine``) and by everything that reads a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from planner.costs import NO_STACK, CostModel, ServingStack

if TYPE_CHECKING:
    from autoscaling.policy import Policy


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class SystemSpec:
    """One configuration to simulate. Colocated: ``prefill_replicas`` replicas doing both
    phases at ``prefill_cost`` (``decode_replicas`` and ``decode_cost`` are ignored)."""

    kind: Literal["disaggregated", "colocated"]
    prefill_replicas: int
    decode_replicas: int
    prefill_cost: CostModel
    decode_cost: CostModel
    chunked_prefill: bool = False  # colocated only
    # colocated only: vLLM <= 0.2's scheduler (DistServe's baseline): a step runs the waiting
    # prompts it can admit alone, the running decodes wait; decodes step when none can be admitted
    prefill_first: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    interference: float = 0.0  # slowdown of a step while another replica computes (0 on separate GPUs)
    policy: Policy | None = None  # elastic lending per an autoscaling policy (disaggregated only)
    stack: ServingStack = NO_STACK  # the serving stack's share (calibrated on shared CPU cores; 0 on GPUs)

    @property
    def num_replicas(self) -> int:
        return self.prefill_replicas if self.kind == "colocated" else self.prefill_replicas + self.decode_replicas


@dataclass(frozen=True)
class SimRecord:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    ttft_s: float
    tpot_s: float | None  # None for a one-token output
    e2e_s: float

    def met(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        """Both SLOs met (as ``bench.slo.SLO.met``: a one-token output meets the TPOT half)."""
        return self.ttft_s <= ttft_slo_s and (self.tpot_s is None or self.tpot_s <= tpot_slo_s)


def _distribution(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 with numpy's linear percentiles (as ``bench.slo.distribution``)."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    array = np.asarray(values, dtype=float)
    return {
        "mean": float(array.mean()),
        **{f"p{p}": float(np.percentile(array, p)) for p in (50, 90, 99)},
    }


@dataclass(frozen=True)
class SimResult:
    records: tuple[SimRecord, ...]  # in arrival order
    actions: tuple[tuple[float, str, int], ...] = ()  # elastic: (time, lend/reclaim, replica index)

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """Share of requests meeting both SLOs (DistServe's SLO attainment)."""
        if not self.records:
            return 0.0
        return sum(r.met(ttft_slo_s, tpot_slo_s) for r in self.records) / len(self.records)

    def percentiles(self) -> dict[str, dict[str, float]]:
        return {
            "ttft_s": _distribution([r.ttft_s for r in self.records]),
            "tpot_s": _distribution([r.tpot_s for r in self.records if r.tpot_s is not None]),
            "e2e_s": _distribution([r.e2e_s for r in self.records]),
        }
