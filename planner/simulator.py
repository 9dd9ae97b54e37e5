"""Discrete-event simulation of the served systems: ``simulate(system, requests) -> SimResult``.

What one run models (``planner.sim_engine`` holds the replica model, ``planner.sim_elastic``
the autoscaler's lending, ``planner.sim_types`` the inputs and outputs):

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
  ``decide`` and ``decide_counts`` run on a snapshot of the simulated replicas (their loads
  ``SystemSpec.world.report_delay_s`` old), and requests are routed by the ingress's own
  ``autoscaling.routing.RouteBook``: lent replicas take whole decode-heavy requests, prompt
  placement sends prompts the prefill queue would delay to a decode replica, and new replicas
  serve after ``world.startup_s`` (a share ``world.never_start`` never does, until the policy
  gives them up). ``planner.sim_elastic`` says what each step follows.

Not modelled anywhere: preemption (a request's whole KV is reserved at admission), prefix
caching, network contention between transfers, HTTP and Serve overheads beyond the
serving-stack terms and the interference factor. All choices are deterministic (a seeded generator breaks router ties).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from planner.sim_elastic import Elastic
from planner.sim_engine import Simulation
from planner.sim_types import SimRecord, SimRequest, SimResult, SystemSpec
from workloads.lengths import arrival_times, check_workload, draw_lengths

__all__ = [
    "SimRecord",
    "SimRequest",
    "SimResult",
    "SystemSpec",
    "goodput",
    "sim_requests",
    "simulate",
    "uncontended_latency",
]


def simulate(system: SystemSpec, requests: Sequence[SimRequest]) -> SimResult:
    """Run ``requests`` (any order; sorted by arrival here) through ``system``."""
    simulation = Simulation(system, requests)
    if system.policy is not None and system.kind == "disaggregated":
        simulation.elastic = Elastic(simulation, system.policy)
    return simulation.run()


def sim_requests(
    name: str,
    rate: float,
    num_requests: int,
    max_model_len: int,
    seed: int = 0,
    process: str = "poisson",
    cv: float = 1.0,
) -> list[SimRequest]:
    """``num_requests`` requests of workload ``name`` (lengths only) arriving at ``rate``:
    the lengths ``workloads.make_requests`` gives for ``seed`` and the offsets ``bench.serve``
    sends them at for ``seed`` (both from ``workloads.lengths``). For a model with another
    context (OPT-66B's 2,048, ...) pass its ``max_model_len``: every length scales with it."""
    check_workload(name)
    rng = np.random.default_rng(seed)
    drawn = [draw_lengths(name, rng, max_model_len - 1) for _ in range(num_requests)]
    offsets = arrival_times(num_requests, rate, process, cv, seed)
    return [SimRequest(float(t), d.prompt_tokens, d.output_tokens) for t, d in zip(offsets, drawn)]


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
