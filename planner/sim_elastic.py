"""The elastic autoscaler inside a simulation: the served controller's own pure decision.

Every ``policy.interval_s`` simulated seconds a ``Snapshot`` of the simulated replicas (the
loads each engine reports: running, decoding, waiting, queued prompt tokens, KV blocks) and of
the latencies the ingress saw over ``policy.window_s`` goes through ``autoscaling.decide.decide``,
the function the ``AutoscalerController`` runs; its lends and reclaims change the replicas'
roles at once (the served system's role change takes one report, about a second). Routing
follows the ingress (``deployments/elastic_routing.py``): a decode-heavy request (no more
prompt tokens than output tokens) goes whole to the least loaded lent replica while the lent
pool has fewer requests in flight per replica than the decode pool (``prefer_lent``).

Replica counts (``policy.scaling.enabled``): the same snapshot goes through
``autoscaling.scale.decide_counts``; a pool that grows gets new replicas that serve
``STARTUP_S`` later (decision to serving as ``bench.scaling`` measured it:
``docs/benchmarks/elastic.md``, "Replica-count scaling") and report nothing before; a pool
that shrinks stops routing to its least loaded replica (never a lent one), which finishes
its work and leaves.

Modelled: lending, reclaiming (a reclaimed replica takes no new whole requests; its decodes
finish), drain, cooldown, hysteresis, every decode and prefill signal, replica-count scaling
with a start-up delay. Not modelled: prompt placement on decode replicas, report delays,
Serve's give-up of replicas that never start (every asked replica starts here).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from autoscaling.decide import ActionKind, ControllerState, decide
from autoscaling.messages import LatencySample
from autoscaling.placement import decode_heavy, prefer_lent
from autoscaling.policy import Policy
from autoscaling.scale import ScaleEvent, ScaleState, decide_counts
from autoscaling.snapshot import Observed, ReplicaLoad, Snapshot
from engine.params import Role
from planner.sim_engine import Replica

if TYPE_CHECKING:
    from planner.sim_engine import Req, Simulation

BLOCK_SIZE = 16
STARTUP_S = 27.0  # decision to a new replica serving (bench.scaling: docs/benchmarks/elastic.md)
ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.BOTH}


class Elastic:
    """Lending state of one simulation; the engine calls ``tick``, ``lent_target``, ``finished``."""

    def __init__(self, sim: Simulation, policy: Policy) -> None:
        self.sim, self.policy = sim, policy
        self.interval_s = policy.interval_s
        self.state = ControllerState()
        self.scale_state = ScaleState()
        self.window: deque[tuple[float, LatencySample]] = deque()  # (finished at, sample)
        self.actions: list[tuple[float, str, int]] = []
        self.disaggregated_in_flight = 0
        self.lent_in_flight = 0
        self.lent: list[Replica] = []
        self.reporting: dict[str, Replica] = {str(r.index): r for r in (*sim.prefill, *sim.decode)}
        self.starting: list[tuple[float, Replica]] = []  # (serving from, replica)
        self.leaving: list[Replica] = []  # no longer routed to, finishing their work
        self.next_index = len(self.reporting)

    def lent_target(self, req: Req) -> Replica | None:
        """The lent replica for a request arriving now, or None (the disaggregated path)."""
        lent = self.lent
        route_lent = (
            lent
            and decode_heavy(req.prompt, req.output)
            and prefer_lent(self.disaggregated_in_flight, len(self.sim.decode), self.lent_in_flight, len(lent))
        )
        if route_lent:
            self.lent_in_flight += 1
            return min(lent, key=lambda r: (r.in_flight, r.index))
        self.disaggregated_in_flight += 1
        return None

    def finished(self, req: Req, now: float) -> None:
        if req.whole:
            self.lent_in_flight -= 1
        else:
            self.disaggregated_in_flight -= 1
        tpot = (now - req.first_s) / (req.output - 1) if req.output > 1 else None
        self.window.append((now, LatencySample(req.first_s - req.arrival, tpot, None if req.whole else req.prefill_s)))

    def tick(self, now: float) -> None:
        self._arrivals_and_departures(now)
        while self.window and self.window[0][0] < now - self.policy.window_s:
            self.window.popleft()
        snapshot = Snapshot(
            time=now,
            replicas=tuple(self._load(r) for r in self.reporting.values()),
            observed=Observed.of([sample for _, sample in self.window], self.policy.min_samples),
        )
        actions = decide(snapshot, self.policy, self.state)
        self.state = self.state.after(actions, now)
        for action in actions:
            replica = self.reporting[action.replica]
            if action.kind is ActionKind.LEND:
                replica.role = "both"
                self.lent.append(replica)
            elif action.kind is ActionKind.RECLAIM:
                replica.role = "prefill"
                self.lent.remove(replica)
            self.actions.append((now, action.kind.value, replica.index))
        self.scale_state, events = decide_counts(snapshot, self.policy, self.scale_state, self.state.lent)
        for event in events:
            self._scale(event, now)

    def _scale(self, event: ScaleEvent, now: float) -> None:
        """Start replicas for a grown target; stop routing to one for a shrunk one."""
        pool = event.pool.value  # "prefill" | "decode"
        self.actions.append((now, f"{event.kind.value}:{pool}", event.new))
        routed = self.sim.prefill if pool == "prefill" else self.sim.decode
        coming = sum(1 for _, r in self.starting if r.home == pool)
        if event.new > len(routed) + coming:
            cost = self.sim.system.prefill_cost if pool == "prefill" else self.sim.system.decode_cost
            for _ in range(event.new - len(routed) - coming):
                self.starting.append((now + STARTUP_S, Replica(self.next_index, pool, cost)))
                self.next_index += 1
        elif event.new < len(routed) and len(routed) > 1:
            candidates = [r for r in routed if r.role == pool]  # never a lent replica
            if candidates:
                victim = min(candidates, key=lambda r: (r.in_flight, -r.index))
                self._set_routed(pool, [r for r in routed if r is not victim])
                self.leaving.append(victim)

    def _arrivals_and_departures(self, now: float) -> None:
        ready = [r for t, r in self.starting if t <= now]
        if ready:
            self.starting = [(t, r) for t, r in self.starting if t > now]
            for replica in ready:
                self.reporting[str(replica.index)] = replica
                pool = self.sim.prefill if replica.home == "prefill" else self.sim.decode
                self._set_routed(replica.home, [*pool, replica])
        for replica in [r for r in self.leaving if r.in_flight == 0 and not r.busy]:
            self.leaving.remove(replica)
            del self.reporting[str(replica.index)]

    def _set_routed(self, pool: str, replicas: list[Replica]) -> None:
        if pool == "prefill":
            self.sim.prefill = replicas
        else:
            self.sim.decode = replicas

    @staticmethod
    def _load(replica: Replica) -> ReplicaLoad:
        total = replica.cost.kv_capacity_tokens // BLOCK_SIZE
        used = -(-replica.kv_used // BLOCK_SIZE)
        whole_waiting = sum(1 for r in replica.queue if r.whole)
        return ReplicaLoad(
            replica=str(replica.index),
            deployment="PrefillServer" if replica.home == "prefill" else "DecodeServer",
            home=ROLES[replica.home],
            role=ROLES[replica.role],
            running=replica.num_running + len(replica.prefilling),
            decoding=replica.decoding + whole_waiting,
            waiting=len(replica.kv_wait) + len(replica.queue),
            queued_prompt_tokens=replica.queued_tokens,
            free_blocks=max(total - used, 0),
            pinned_blocks=0,
            total_blocks=total,
            median_step_ms=0.0,
        )
