"""The simulator's inputs and outputs (``planner.simulator.simulate``): the requests, the
system simulated, and what each request measured. Plain frozen data, used by the replica
model (``planner.sim_engine``) and by everything that reads a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
class ElasticWorld:
    """What the served autoscaler meets beyond its policy, for a simulation of it."""

    startup_s: float = 27.0  # a decision to a new replica serving (CPU: docs/benchmarks/elastic.md)
    report_delay_s: float = 0.0  # the controller decides on replica loads this old
    never_start: float = 0.0  # the share of new replicas that never start (a pod left Pending)
    seed: int = 0  # draws which replicas never start


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
    world: ElasticWorld = ElasticWorld()  # start-up, report delay and failed starts under ``policy``
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


def distribution(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (numpy's linear percentiles, as ``vllm bench serve``): the benchmarks'
    figures too (``bench.slo``)."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    array = np.asarray(values, dtype=float)
    return {
        "mean": float(array.mean()),
        **{f"p{p}": float(np.percentile(array, p)) for p in (50, 90, 99)},
    }


@dataclass(frozen=True)
class SimDecision:
    """One decision of the simulated autoscaler: a lend, reclaim or drain of ``replica``, or a
    pool's count (``old`` -> ``new``: scale_up, scale_down, give_up), with the policy's reason."""

    time_s: float
    kind: str
    pool: str  # prefill | decode
    reason: str
    replica: int | None = None
    old: int | None = None
    new: int | None = None


@dataclass(frozen=True)
class PoolSample:
    """The replicas at one instant: routed per pool (lent ones among the prefill), lent, asked
    for and not serving yet (starting, or never to start), leaving (finishing their work), and
    per pool every one of these that holds devices."""

    time_s: float
    prefill: int
    decode: int
    lent: int = 0
    starting: int = 0
    leaving: int = 0
    held_prefill: int = 0
    held_decode: int = 0

    @property
    def held(self) -> int:
        return self.held_prefill + self.held_decode


@dataclass(frozen=True)
class SimResult:
    records: tuple[SimRecord, ...]  # in arrival order
    decisions: tuple[SimDecision, ...] = ()  # elastic only
    timeline: tuple[PoolSample, ...] = ()  # elastic: one per decision interval
    # replicas held x seconds per pool (prefill, decode; colocated: both), from 0 to the last request's end
    replica_seconds: dict[str, float] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)  # elastic: requests per route (lent, on_decode, ...)

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """Share of requests meeting both SLOs (DistServe's SLO attainment)."""
        if not self.records:
            return 0.0
        return sum(r.met(ttft_slo_s, tpot_slo_s) for r in self.records) / len(self.records)

    def percentiles(self) -> dict[str, dict[str, float]]:
        return {
            "ttft_s": distribution([r.ttft_s for r in self.records]),
            "tpot_s": distribution([r.tpot_s for r in self.records if r.tpot_s is not None]),
            "e2e_s": distribution([r.e2e_s for r in self.records]),
        }
