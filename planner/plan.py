"""Placement search: how many prefill and decode replicas, at which tensor-parallel degree, serve
a rate within both SLOs on the fewest GPUs (DistServe's goodput per GPU, OSDI'24 section 4).

The search, in three steps, so that 1,000 GPUs cost no more to plan than 8:

1. **Per-phase goodput, once per (phase, TP)**: one replica of the phase is simulated against an
   ideal other phase (``IdealPhase``: no time, no capacity limit) and ``planner.simulator.goodput``
   finds the highest rate it serves at the attainment target (as DistServe: each phase alone at
   the target; the full-scale simulation of step 3 checks the two together). A colocated replica
   (both phases, with and without chunked prefill) is measured the same way against both SLOs.
2. **Analytic combination** (DistServe's replication): for every (prefill TP, decode TP) pair,
   ``ceil(rate / goodput)`` replicas of each phase; with only ``max_gpus``, the split of the GPUs
   that balances the two phases. Ranked by GPUs needed (with a rate) or by goodput per GPU (with
   only a GPU budget).
3. **Finalists at full scale**: the leading candidates (and the best servable one) are simulated
   as whole systems at the asked rate with ``verify_requests`` requests; a phase that misses its
   SLO gets more replicas (up to ``max_bumps`` times) and the ranking is redone on the results.

A TP degree whose weights and one full-context request do not fit in its GPUs is skipped. A
configuration is servable when the engine can split the model by each of its pools' degrees
(``engine.tensor_parallel.check_degree``: the degree divides the attention heads and the MLP's
width, and the KV heads are divisible by it or divide it; gated MLPs only); the others are ranked
with the reason. The AppConfig / RayService files are written for the best servable one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import ClassVar, Literal

import yaml

from engine.tensor_parallel import check_degree
from planner.costs import CostModel
from planner.roofline import Hardware, ModelShape, RooflineCost
from planner.simulator import SimRequest, SystemSpec, goodput, sim_requests, simulate

Kind = Literal["disaggregated", "colocated"]
IDEAL_STEP_S = 1e-6  # an ideal phase's step: positive, so simulated time always advances


@dataclass(frozen=True)
class IdealPhase:
    """The phase not under study: (almost) no time, no KV limit; KV transfers as ``real``'s."""

    real: CostModel
    constant_decode_step: ClassVar[bool] = True  # for the simulator: one step's time is every step's

    def prefill_s(self, batch_tokens: int) -> float:
        return IDEAL_STEP_S

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        return IDEAL_STEP_S if batch_size > 0 else 0.0

    def transfer_s(self, num_bytes: int) -> float:
        return self.real.transfer_s(num_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.real.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return 1 << 40


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks: a model on a GPU type, two SLOs, a workload, and a rate or a GPU budget."""

    shape: ModelShape
    hardware: Hardware
    workload: str
    ttft_slo_s: float
    tpot_slo_s: float
    rate: float | None = None  # req/s to serve; None: as much as max_gpus allows
    max_gpus: int | None = None
    max_model_len: int = 2048
    target: float = 0.9  # SLO attainment (DistServe: 90%)
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    colocated: bool = False  # also rank colocated replicas (with and without chunked prefill)
    # the colocated replicas' scheduler: this engine's (decodes and prompts mixed in a step) or
    # "prefill-first", vLLM 0.2's (DistServe's baseline; a reference, never servable here)
    colocated_scheduler: Literal["mixed", "prefill-first"] = "mixed"
    phase_requests: int = 400  # requests per simulation when measuring one replica (at least; up to 4x)
    phase_seconds: float = 30.0  # ... or this many seconds of arrivals
    verify_requests: int = 3000  # requests per full-scale simulation of a finalist
    max_bumps: int = 3
    max_num_seqs: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is None and self.max_gpus is None:
            raise ValueError("give a rate (req/s) or a GPU budget (max_gpus), or both")

    @property
    def batched_tokens(self) -> int:
        return max(2048, self.max_model_len)

    def requests(self, rate: float, num_requests: int) -> list[SimRequest]:
        return sim_requests(self.workload, rate, num_requests, self.max_model_len, seed=self.seed)


@dataclass(frozen=True)
class PhaseGoodput:
    """Goodput (req/s) of ONE replica of a phase at a TP degree; ``phase``: prefill, decode,
    colocated or colocated-chunked."""

    phase: str
    tp: int
    goodput: float


@dataclass(frozen=True)
class Candidate:
    """A configuration: replicas and TP per pool (colocated: the prefill fields), its analytic
    capacity (req/s within the SLOs) and, once simulated, what the simulation predicts."""

    kind: Kind
    prefill_tp: int
    prefill_replicas: int
    decode_tp: int = 0
    decode_replicas: int = 0
    chunked_prefill: bool = False
    prefill_first: bool = False  # colocated with vLLM 0.2's scheduler (a reference, not servable)
    unservable: str | None = None  # why the engine cannot split the model by these degrees (None: it can)
    prefill_goodput: float = 0.0  # req/s of one replica (colocated: of one colocated replica)
    decode_goodput: float = 0.0
    attainment: float | None = None
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    simulated_rate: float | None = None

    @property
    def capacity(self) -> float:
        """Req/s the configuration serves within the SLOs, by replicating the per-replica goodputs."""
        if self.kind == "colocated":
            return self.prefill_replicas * self.prefill_goodput
        return min(self.prefill_replicas * self.prefill_goodput, self.decode_replicas * self.decode_goodput)

    @property
    def num_gpus(self) -> int:
        return self.prefill_tp * self.prefill_replicas + self.decode_tp * self.decode_replicas

    @property
    def goodput_per_gpu(self) -> float:
        return self.capacity / self.num_gpus

    @property
    def servable(self) -> bool:
        """The engine runs it: every pool's TP degree splits the model, this engine's scheduler."""
        return self.unservable is None and not self.prefill_first

    @property
    def degrees(self) -> dict[str, int]:
        """Each pool's TP degree, by its AppConfig section."""
        if self.kind == "colocated":
            return {"colocated": self.prefill_tp}
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}

    @property
    def label(self) -> str:
        if self.kind == "colocated":
            chunked = "+chunked" if self.chunked_prefill else ""
            chunked += "(prefill-first)" if self.prefill_first else ""
            return f"colocated{chunked} {self.prefill_replicas}x TP{self.prefill_tp}"
        return f"P {self.prefill_replicas}x TP{self.prefill_tp} : D {self.decode_replicas}x TP{self.decode_tp}"


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    phases: tuple[PhaseGoodput, ...]
    ranked: tuple[Candidate, ...]  # best first; the finalists carry simulation results

    def best_servable(self) -> Candidate | None:
        return next((c for c in self.ranked if c.servable), None)


# -- step 1: one replica of each phase ------------------------------------------------------
def _spec(
    request: PlanRequest, kind: Kind, prefill: CostModel, decode: CostModel, chunked: bool = False, first: bool = False
):
    return SystemSpec(
        kind=kind,
        prefill_replicas=1,
        decode_replicas=1,
        prefill_cost=prefill,
        decode_cost=decode,
        chunked_prefill=chunked,
        prefill_first=first,
        max_num_batched_tokens=request.batched_tokens,
        max_num_seqs=request.max_num_seqs,
    )


def _goodput(request: PlanRequest, system: SystemSpec, slo: tuple[float, float], target: float, bound: float) -> float:
    def make(rate: float) -> list[SimRequest]:
        # at least ``phase_seconds`` of arrivals, so a busy replica reaches its steady state
        count = min(max(request.phase_requests, int(rate * request.phase_seconds)), 4 * request.phase_requests)
        return request.requests(rate, count)

    return goodput(system, make, *slo, target=target, max_rate=bound, rel_tol=0.03)


@dataclass(frozen=True)
class _Means:
    prompt_tokens: float
    output_tokens: float


def _means(request: PlanRequest) -> _Means:
    sample = request.requests(1.0, request.phase_requests)
    return _Means(
        sum(r.prompt_tokens for r in sample) / len(sample), sum(r.output_tokens for r in sample) / len(sample)
    )


def _bounds(request: PlanRequest, cost: RooflineCost, means: _Means) -> tuple[float, float]:
    """Twice the rate one replica of each phase could reach with no SLO at all (full batches):
    the top of the goodput search, so that a finite burst of requests never reads as infinite."""
    budget = request.batched_tokens
    prefill = budget / cost.prefill_s(budget) / means.prompt_tokens
    per_request = means.prompt_tokens + means.output_tokens
    batch = max(1, min(request.max_num_seqs, int(cost.kv_capacity_tokens // per_request)))
    context = int(batch * (means.prompt_tokens + means.output_tokens / 2))
    decode = batch / (means.output_tokens * cost.decode_step_s(batch, context))
    return 2 * prefill, 2 * decode


def phase_goodputs(request: PlanRequest) -> list[PhaseGoodput]:
    """Goodput of one replica per (phase, TP), for the TP degrees where the model fits."""
    means, out = _means(request), []
    both, target = (request.ttft_slo_s, request.tpot_slo_s), request.target
    for tp in request.tp_degrees:
        cost = RooflineCost(request.shape, request.hardware, tp)
        if tp > request.hardware.gpus_per_node or not cost.fits(request.max_model_len):
            continue
        prefill_bound, decode_bound = _bounds(request, cost, means)
        system = _spec(request, "disaggregated", cost, IdealPhase(cost))
        out.append(PhaseGoodput("prefill", tp, _goodput(request, system, (both[0], math.inf), target, prefill_bound)))
        system = _spec(request, "disaggregated", IdealPhase(cost), cost)
        out.append(PhaseGoodput("decode", tp, _goodput(request, system, both, target, decode_bound)))
        if request.colocated:
            first = request.colocated_scheduler == "prefill-first"
            for chunked in (False,) if first else (False, True):
                system = _spec(request, "colocated", cost, cost, chunked, first)
                rate = _goodput(request, system, both, request.target, min(prefill_bound, decode_bound))
                phase = "colocated-prefill-first" if first else "colocated-chunked" if chunked else "colocated"
                out.append(PhaseGoodput(phase, tp, rate))
    return out


# -- step 2: replicate and combine analytically ---------------------------------------------
def _split(budget: int, p: PhaseGoodput, d: PhaseGoodput) -> tuple[int, int]:
    """Replica counts within ``budget`` GPUs that balance the two phases' capacities."""
    best, best_capacity = (0, 0), -1.0
    guess = int(budget * d.goodput / (d.goodput * p.tp + p.goodput * d.tp))
    for n_p in range(max(1, guess - 1), guess + 3):
        n_d = (budget - n_p * p.tp) // d.tp
        capacity = min(n_p * p.goodput, n_d * d.goodput)
        if n_d >= 1 and capacity > best_capacity:
            best, best_capacity = (n_p, n_d), capacity
    return best


def _disaggregated(request: PlanRequest, p: PhaseGoodput, d: PhaseGoodput) -> Candidate | None:
    if request.rate is not None:
        n_p, n_d = math.ceil(request.rate / p.goodput), math.ceil(request.rate / d.goodput)
    else:
        n_p, n_d = _split(request.max_gpus or 0, p, d)
    if n_p < 1 or n_d < 1:
        return None
    return Candidate("disaggregated", p.tp, n_p, d.tp, n_d, prefill_goodput=p.goodput, decode_goodput=d.goodput)


def _colocated(request: PlanRequest, c: PhaseGoodput) -> Candidate | None:
    if request.rate is not None:
        n = math.ceil(request.rate / c.goodput)
    else:
        n = (request.max_gpus or 0) // c.tp
    if n < 1:
        return None
    chunked, first = c.phase == "colocated-chunked", c.phase == "colocated-prefill-first"
    return Candidate("colocated", c.tp, n, chunked_prefill=chunked, prefill_first=first, prefill_goodput=c.goodput)


def split_refusal(shape: ModelShape, degrees: dict[str, int]) -> str | None:
    """Why the engine cannot split ``shape`` by each pool's TP degree (``check_degree``'s message,
    naming the setting and the model's sizes), or None. ``check_degree`` reads transformers'
    names of the sizes; ``ModelShape`` has them from the same config.json (OPT's too)."""
    sizes = SimpleNamespace(
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
    )
    reasons = []
    for section, degree in degrees.items():
        field = f"{section}.tensor_parallel_size"
        if degree > 1 and not shape.gated_mlp:
            reasons.append(f"{field}={degree}: the engine splits only gated MLPs (gate, up, down projections)")
            continue
        try:
            check_degree(sizes, degree, field)
        except ValueError as refused:
            reasons.append(str(refused))
    return "; ".join(reasons) or None


def combine(request: PlanRequest, phases: Sequence[PhaseGoodput]) -> list[Candidate]:
    """Every configuration the per-replica goodputs allow, within ``max_gpus``, best first; each
    marked with why the engine cannot serve it, if it cannot."""
    live = [g for g in phases if g.goodput > 0]
    prefills = [g for g in live if g.phase == "prefill"]
    decodes = [g for g in live if g.phase == "decode"]
    found = [_disaggregated(request, p, d) for p in prefills for d in decodes]
    found += [_colocated(request, c) for c in live if c.phase.startswith("colocated")]
    fits = [c for c in found if c is not None and (request.max_gpus is None or c.num_gpus <= request.max_gpus)]
    marked = [replace(c, unservable=split_refusal(request.shape, c.degrees)) for c in fits]
    return sorted(marked, key=lambda c: _analytic_rank(request, c))


def _analytic_rank(request: PlanRequest, c: Candidate) -> tuple:
    """With a rate: fewest GPUs that reach it; with a GPU budget: most goodput per GPU."""
    if request.rate is None:
        return (-c.goodput_per_gpu, c.num_gpus, c.label)
    return (c.num_gpus, -c.goodput_per_gpu, c.label)


# -- step 3: simulate the finalists at full scale ----------------------------------------------
def _system(request: PlanRequest, c: Candidate) -> SystemSpec:
    prefill = RooflineCost(request.shape, request.hardware, c.prefill_tp)
    decode = RooflineCost(request.shape, request.hardware, c.decode_tp or c.prefill_tp)
    return replace(
        _spec(request, c.kind, prefill, decode, c.chunked_prefill, c.prefill_first),
        prefill_replicas=c.prefill_replicas,
        decode_replicas=c.decode_replicas,
    )


def _simulated(request: PlanRequest, c: Candidate) -> Candidate:
    rate = request.rate if request.rate is not None else c.capacity
    result = simulate(_system(request, c), request.requests(rate, request.verify_requests))
    p90 = result.percentiles()
    attainment = result.attainment(request.ttft_slo_s, request.tpot_slo_s)
    return replace(
        c,
        attainment=attainment,
        ttft_p90_s=p90["ttft_s"]["p90"],
        tpot_p90_s=p90["tpot_s"]["p90"],
        simulated_rate=rate,
    )


def _grown(c: Candidate, pool: str) -> Candidate:
    """``pool`` with one more step of replicas: 5%, at least 1."""
    count = getattr(c, f"{pool}_replicas")
    return replace(c, **{f"{pool}_replicas": count + max(1, count // 20)})


def verify(request: PlanRequest, candidate: Candidate) -> Candidate:
    """Simulate the whole system; with a rate to meet, grow it until it meets the target (at
    most ``max_bumps`` times, never past ``max_gpus``). A TTFT miss can come from either pool
    (prefill queueing, or decode replicas short of KV), so each step tries growing each pool
    and keeps the better."""
    checked = _simulated(request, candidate)
    pools = ("prefill",) if candidate.kind == "colocated" else ("prefill", "decode")
    for _ in range(request.max_bumps if request.rate is not None else 0):
        if checked.attainment is not None and checked.attainment >= request.target:
            break
        options = [_grown(checked, pool) for pool in pools]
        options = [c for c in options if request.max_gpus is None or c.num_gpus <= request.max_gpus]
        if not options:
            break
        checked = max((_simulated(request, c) for c in options), key=lambda c: (c.attainment, -c.num_gpus))
    return checked


def _final_rank(request: PlanRequest, c: Candidate) -> tuple:
    simulated = c.attainment is not None
    meets = simulated and c.attainment >= request.target
    return (not meets, not simulated, *_analytic_rank(request, c))


def _first(ranked: Sequence[Candidate], keep) -> Candidate | None:
    return next((c for c in ranked if keep(c)), None)


def plan(request: PlanRequest, finalists: int = 5) -> Plan:
    """Search, combine, and simulate the ``finalists`` leading configurations (and the best
    servable and the best colocated one) at full scale; returns every candidate, best first."""
    phases = phase_goodputs(request)
    ranked = combine(request, phases)
    chosen = ranked[:finalists]
    for leading in (_first(ranked, lambda c: c.servable), _first(ranked, lambda c: c.kind == "colocated")):
        if leading is not None and leading not in chosen:
            chosen.append(leading)
    checked = [verify(request, c) for c in chosen]
    rest = [c for c in ranked if c not in chosen]
    final = sorted(checked, key=lambda c: _final_rank(request, c)) + rest
    return Plan(request, tuple(phases), tuple(final))


# -- what to deploy -------------------------------------------------------------------------
def _kv_cache_bytes(request: PlanRequest, degrees: Sequence[int]) -> int:
    """``engine.kv_cache_bytes``, whole MiB: each rank's pool (a TP engine's ranks hold as many
    blocks as rank 0's pool), one setting for every pool. The roofline's room on one GPU after
    its share of the weights, at the plan's smallest degree (the least room per GPU)."""
    per_rank = min(RooflineCost(request.shape, request.hardware, tp).kv_pool_bytes / tp for tp in degrees)
    return int(per_rank) >> 20 << 20


def app_config(plan_: Plan, candidate: Candidate, model_source: str) -> dict:
    """The ``AppConfig`` (``app/settings.py``) fields for a servable candidate, as plain data:
    the pools' replica counts and TP degrees (one GPU per rank), pinned by ``prefill_node`` /
    ``decode_node``; KV by pull when a degree is above 1 (push otherwise); each rank's KV pool
    the roofline leaves after its weights; the SLOs; fixed pools (the plan sized them)."""
    if candidate.prefill_first:
        raise ValueError(f"{candidate.label} steps as vLLM 0.2 did, a reference only: this engine mixes its steps")
    if not candidate.servable:
        raise ValueError(f"{candidate.label} is not servable: {candidate.unservable}")
    request, degrees = plan_.request, candidate.degrees
    config: dict = {
        "model": {
            "source": model_source,
            "device": "cuda",
            "dtype": "bfloat16",
            "max_model_len": request.max_model_len,
        },
        "engine": {
            "kv_cache_bytes": _kv_cache_bytes(request, list(degrees.values())),
            "max_num_seqs": request.max_num_seqs,
            "max_num_batched_tokens": request.batched_tokens,
            "enable_chunked_prefill": candidate.chunked_prefill,
        },
        "slo": {"ttft_ms": request.ttft_slo_s * 1000, "tpot_ms": request.tpot_slo_s * 1000},
    }
    pool = {"num_cpus": 4, "num_gpus": 1, "torch_threads": 4}  # per rank
    pull = max(degrees.values()) > 1  # a push between TP pools is not layer-pipelined: no gain over pull
    if candidate.kind == "colocated":
        replicas = candidate.prefill_replicas
        config["colocated"] = {**pool, "tensor_parallel_size": degrees["colocated"], "num_replicas": replicas}
        if pull:
            config["transport"] = {"kind": "nixl", "mode": "pull"}
        config["autoscaling"] = {"enabled": False}
        return config
    for section, replicas in (("prefill", candidate.prefill_replicas), ("decode", candidate.decode_replicas)):
        config[section] = {**pool, "tensor_parallel_size": degrees[section], "num_replicas": replicas}
        config[section]["resources"] = {f"{section}_node": 1}
    config["transport"] = {"kind": "nixl", "mode": "pull" if pull else "push"}
    config["autoscaling"] = {"enabled": True, "policy": "default", "replica_scaling": False}
    return config


def _worker_group(name: str, resource: str | None, replicas: int, tp: int, gpus_per_node: int) -> dict:
    """Pods of whole replicas: a replica's ``tp`` ranks (one GPU each) share a pod, as its
    placement group's STRICT_PACK bundles need one node."""
    per_pod = min(gpus_per_node // tp, replicas)
    pods, gpus = math.ceil(replicas / per_pod), per_pod * tp
    limits = {"cpu": str(4 * gpus), "memory": f"{64 * gpus}Gi", "nvidia.com/gpu": str(gpus)}
    group: dict = {"groupName": name, "replicas": pods, "minReplicas": pods, "maxReplicas": pods}
    group["rayStartParams"] = {"num-gpus": str(gpus)}
    if resource:
        group["rayStartParams"]["resources"] = f'"{{\\"{resource}\\": {gpus}}}"'
    group["template"] = {"spec": {"containers": [{"name": "ray-worker", "resources": {"limits": limits}}]}}
    return group


def rayservice_snippet(plan_: Plan, candidate: Candidate, model_source: str) -> dict:
    """The parts of ``deploy/kuberay/rayservice.yaml`` the plan decides: ``serveConfigV2``'s
    application (its ``args`` are ``app_config``) and one worker group per pool, its pods
    holding as many whole replicas as ``gpus_per_node`` GPUs allow (one GPU per rank) and
    offering the pool's pinning resource, one per GPU."""
    args = app_config(plan_, candidate, model_source)
    gpus_per_node = plan_.request.hardware.gpus_per_node
    colocated = candidate.kind == "colocated"
    application = {
        "name": "tandem",
        "route_prefix": "/",
        "import_path": "app.config:colocated_app" if colocated else "app.config:disagg_app",
        "args": args,
    }
    if colocated:
        groups = [_worker_group("colocated", None, candidate.prefill_replicas, candidate.prefill_tp, gpus_per_node)]
    else:
        groups = [
            _worker_group("prefill", "prefill_node", candidate.prefill_replicas, candidate.prefill_tp, gpus_per_node),
            _worker_group("decode", "decode_node", candidate.decode_replicas, candidate.decode_tp, gpus_per_node),
        ]
    serve_config = yaml.safe_dump({"applications": [application]}, sort_keys=False)
    return {"spec": {"serveConfigV2": serve_config, "rayClusterConfig": {"workerGroupSpecs": groups}}}
