"""Discrete-event simulation of the served systems: ``simulate(system, requests) -> SimResult``.

What one run models (``planner.sim_engine`` holds the replica model, ``planner.sim_elastic``
the autoscaler's lending):

* **disaggregated (pull)**: the ingress sends each prompt to a prefill replica (the less
  loaded of two, as Serve's power-of-two router; every replica when there are two or fewer).
  A prefill replica runs FIFO batches of whole prompts up to ``max_num_batched_tokens`` and
  ``max_num_seqs``, one forward of ``prefill_s(sum of the batch)`` each. The first token is
  sampled there; a one-token request ends at that step. Otherwise the ingress picks a decode
  replica, which reserves the request's KV (prompt + output tokens; a request that does not
  fit waits, FIFO), pulls it (``transfer_s(prompt_tokens * kv_bytes_per_token)``) and admits it
  at its next step boundary: the first token leaves then (pull: the decode replica streams
  every token, the prefilled one first; ``deployments/ingress.py``). Decode steps serve every
  running request one token, ``decode_step_s(batch, sum of KV lengths)`` each.
* **colocated**: each replica runs the engine's scheduler (``engine/scheduler.py``): every step
  serves the running decodes first (one token each), then admits waiting prompts in FIFO order
  while the token budget, ``max_num_seqs`` and the KV pool allow, so prompts and decodes share
  steps. Without chunked prefill a prompt runs whole (it waits until it fits the budget left);
  with it, prompts are cut to the budget left and continue in the next steps. A step's time is
  the cost of its mix (``mixed_step_s``). ``prefill_first`` models vLLM 0.2's scheduler instead
  (the baseline of DistServe's figures): prompts run in steps of their own while the decodes
  wait.
* **interference** (``SystemSpec.interference``): a replica's step starts ``1 + interference``
  times slower while any other replica is computing; on this 2-core machine all replicas and
  the Serve processes share the cores. 0 on separate GPUs.
* **serving stack** (``SystemSpec.stack``, ``planner.costs.ServingStack``): a fixed time added
  to every TTFT (the HTTP and Serve hops in front of the first token); the served engine's
  slowdown against the bare one (steps with prompt tokens x ``prefill_factor``, decode steps
  x ``decode_factor``); and processor sharing of ``cores`` between the busy replicas and the
  stack's CPU per streamed token. Measured through the served app; none by default.
* **elastic** (``SystemSpec.policy``): every ``policy.interval_s`` the autoscaler's own pure
  ``decide`` runs on a snapshot of the simulated replicas and lends / reclaims prefill
  replicas; a lent replica (role ``both``) keeps taking prompts and takes whole decode-heavy
  requests while it has fewer in flight per replica than the decode pool
  (``autoscaling.placement``). With ``policy.scaling.enabled`` the pools' replica counts follow
  ``autoscaling.scale.decide_counts`` too (new replicas serve after a start-up delay). Not
  modelled: prompt placement on decode replicas.

Not modelled anywhere: preemption (a request's whole KV is reserved at admission), prefix
caching, network contention between transfers, HTTP and Serve overheads beyond the
serving-stack terms and the interference factor. All choices are deterministic (a seeded generator breaks router ties).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


def simulate(system: SystemSpec, requests: Sequence[SimRequest]) -> SimResult:
    """Run ``requests`` (any order; sorted by arrival here) through ``system``."""
    from planner.sim_engine import Simulation

    return Simulation(system, requests).run()


def uncontended_latency(system: SystemSpec, prompt_tokens: int, output_tokens: int = 32) -> tuple[float, float]:
    """(TTFT, TPOT) of one request alone on the idle ``system``: what ``bench.serve.uncontended``
    measures, and what ``bench.compare`` scales into its SLOs (5x TTFT, 2x TPOT on colocated)."""
    (record,) = simulate(system, [SimRequest(0.0, prompt_tokens, output_tokens)]).records
    return record.ttft_s, record.tpot_s or 0.0


def goodput(
    system: SystemSpec,
    make_requests: Callable[[float], Sequence[SimRequest]],
    ttft_slo_s: float,
    tpot_slo_s: float,
    target: float = 0.9,
    max_rate: float | None = None,
    rel_tol: float = 0.01,
) -> float:
    """The highest rate (req/s) whose attainment is >= ``target`` (DistServe's goodput), by
    bracketing (doubling or halving from 1 req/s, or from ``max_rate`` down) then bisection to
    ``rel_tol``. 0 when even a rate of 1e-6 req/s misses; ``max_rate`` when it passes."""

    def passes(rate: float) -> bool:
        return simulate(system, make_requests(rate)).attainment(ttft_slo_s, tpot_slo_s) >= target

    if max_rate is not None and passes(max_rate):
        return max_rate
    rate = 1.0 if max_rate is None else max_rate / 2
    if passes(rate):
        lo, hi = rate, 2 * rate
        while (max_rate is None or hi < max_rate) and passes(hi):
            lo, hi = hi, 2 * hi
            if hi > 1e9:
                return math.inf
        if max_rate is not None:
            hi = min(hi, max_rate)
    else:
        lo, hi = rate / 2, rate
        while not passes(lo):
            lo, hi = lo / 2, lo
            if lo < 1e-6:
                return 0.0
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo
