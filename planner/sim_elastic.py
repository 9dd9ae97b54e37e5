"""The elastic autoscaler inside a simulation: the served controller's own pure decisions and
the served ingress's own routing.

Every ``policy.interval_s`` simulated seconds a ``Snapshot`` of the simulated replicas (the
loads each engine reports: running, decoding, waiting, queued prompt tokens, KV blocks) and of
the latencies the ingress saw over ``policy.window_s`` goes through ``autoscaling.decide.decide``
and ``autoscaling.scale.decide_counts``, the functions the ``AutoscalerController`` runs. The
replicas' loads reach it ``ElasticWorld.report_delay_s`` late (the latest snapshot at least
that old); its lends and reclaims change the replicas' roles at once.

Routing is the ingress's ``autoscaling.routing.RouteBook`` with the plan the controller
hands out (``routing_plan``): a decode-heavy request goes whole to the least loaded lent
replica while the lent pool has fewer requests in flight per replica; a prompt that the
prefill queue would make miss its TTFT goes whole to a decode replica when the decode side
has room (prompt placement, ``policy.prompt_placement``); every other request is
disaggregated. The prefill speed the placement predicts with is the cost model's time for
each prompt alone (what the served ingress measures from a prompt that ran alone).

Replica counts (``policy.scaling.enabled``): a pool that grows gets new replicas that serve
``ElasticWorld.startup_s`` later and report nothing before; a share ``never_start`` of them
never does, until the policy gives them up (``pending_timeout_s``) and the target falls back;
a pool that shrinks stops routing to its least loaded replica (never a lent one), which
finishes its work and leaves. Every decision is kept with its reason, and the replicas held
(routed, starting, leaving) are sampled at each decision for the GPU-hours.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING

from autoscaling.decide import ActionKind, ControllerState, decide
from autoscaling.messages import LatencySample
from autoscaling.policy import Policy
from autoscaling.routing import Route, RouteBook, routing_plan
from autoscaling.scale import ScaleEvent, ScaleKind, ScaleState, decide_counts
from autoscaling.snapshot import Observed, PromptArrivals, ReplicaLoad, Snapshot
from engine.params import Role
from planner.sim_engine import Replica
from planner.sim_types import PoolSample, SimDecision

if TYPE_CHECKING:
    from planner.sim_engine import Req, Simulation

BLOCK_SIZE = 16
ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.BOTH}


class Elastic:
    """Lending, placement and scaling of one simulation; the engine calls ``tick``, ``route``,
    ``prefilled`` and ``finished``."""

    def __init__(self, sim: Simulation, policy: Policy) -> None:
        self.sim, self.policy, self.world = sim, policy, sim.system.world
        self.interval_s = policy.interval_s
        self.state = ControllerState()
        self.scale_state = ScaleState()
        self.book = RouteBook(policy)
        initial = Snapshot(time=0.0, replicas=tuple(self._load(r) for r in (*sim.prefill, *sim.decode)))
        self.plan = routing_plan(initial, self.state)
        self.window: deque[tuple[float, LatencySample]] = deque()  # (finished at, sample)
        self.arrivals = PromptArrivals(policy.window_s, started=0.0)
        self.loads: deque[tuple[float, tuple[ReplicaLoad, ...]]] = deque()  # reported, not yet seen
        self.decisions: list[SimDecision] = []
        self.timeline: list[PoolSample] = []
        self.lent: list[Replica] = []
        self.reporting: dict[str, Replica] = {str(r.index): r for r in (*sim.prefill, *sim.decode)}
        self.starting: list[tuple[float, Replica]] = []  # (serving from, replica); inf: never
        self.leaving: list[Replica] = []  # no longer routed to, finishing their work
        self.next_index = len(self.reporting)
        self.rng = random.Random(self.world.seed)
        self._sample(0.0)

    # ---- the ingress ---------------------------------------------------------------------

    def route(self, req: Req) -> Replica | None:
        """Where a request arriving now runs whole (a lent or a decode replica), or None: the
        disaggregated path."""
        route = self.book.choose(self.plan, req.prompt, req.output)
        if route is Route.LENT and not self.lent:  # the plan lags a reclaim: disaggregated
            route = Route.DISAGGREGATED
        req.route = route
        self.book.enter(route, req.prompt, req.output)
        self.arrivals.add(req.arrival, req.prompt)
        if route is Route.LENT:
            return min(self.lent, key=lambda r: (r.in_flight, r.index))
        if route is Route.ON_DECODE:
            return self.sim.pick(self.sim.decode)
        return None

    def prefilled(self, req: Req) -> None:
        """Its prompt is computed: a disaggregated one's time feeds the prefill speed."""
        alone_s = self.sim.system.prefill_cost.prefill_s(req.prompt) if req.route is Route.DISAGGREGATED else None
        self.book.prefilled(req.route, req.prompt, alone_s)

    def finished(self, req: Req, now: float) -> None:
        self.book.leave(req.route, req.output)
        tpot = (now - req.first_s) / (req.output - 1) if req.output > 1 else None
        prefill_s = req.prefill_s if req.route is Route.DISAGGREGATED else None
        self.window.append((now, LatencySample(req.first_s - req.arrival, tpot, prefill_s)))

    # ---- the controller ------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self._arrivals_and_departures(now)
        while self.window and self.window[0][0] < now - self.policy.window_s:
            self.window.popleft()
        # a stopping replica leaves the reports at once (it reports ``stopping``), as served
        reporting = [r for r in self.reporting.values() if r not in self.leaving]
        self.loads.append((now, tuple(self._load(r) for r in reporting)))
        seen_by = now - self.world.report_delay_s
        while len(self.loads) > 1 and self.loads[1][0] <= seen_by:
            self.loads.popleft()
        snapshot = Snapshot(
            time=now,
            replicas=self.loads[0][1] if self.loads[0][0] <= seen_by else (),  # none reported that long ago
            observed=Observed.of(
                [sample for _, sample in self.window],
                self.policy.min_samples,
                self.arrivals.rate(now),
                self.book.seconds_per_prompt_token,
            ),
        )
        actions = decide(snapshot, self.policy, self.state)
        self.state = self.state.after(actions, now)
        for action in actions:
            if (replica := self.reporting.get(action.replica)) is None:
                continue  # left since the delayed report
            if action.kind is ActionKind.LEND:
                replica.role = "both"
                self.lent.append(replica)
            elif action.kind is ActionKind.RECLAIM and replica in self.lent:
                replica.role = "prefill"
                self.lent.remove(replica)
            self.decisions.append(SimDecision(now, action.kind.value, replica.home, action.reason, replica.index))
        self.scale_state, events = decide_counts(snapshot, self.policy, self.scale_state, self.state.lent)
        for event in events:
            self._scale(event, now)
        self.plan = routing_plan(snapshot, self.state)
        self._sample(now)

    def _scale(self, event: ScaleEvent, now: float) -> None:
        """Start replicas for a grown target (some never start); stop routing to as many as a
        shrunk target leaves out (as Serve stops them); forget the asked ones a give-up leaves out."""
        pool = event.pool.value  # "prefill" | "decode"
        self.decisions.append(SimDecision(now, event.kind.value, pool, event.reason, None, event.old, event.new))
        mine = self.sim.prefill if pool == "prefill" else self.sim.decode  # lent ones stay in their pool
        coming = [(t, r) for t, r in self.starting if r.home == pool]
        if event.kind is ScaleKind.GIVE_UP or event.new < len(mine) + len(coming):
            keep = sorted(coming, key=lambda tr: tr[0])[: max(event.new - len(mine), 0)]
            self.starting = [(t, r) for t, r in self.starting if r.home != pool] + keep
            coming = keep
        if event.new > len(mine) + len(coming):
            cost = self.sim.system.prefill_cost if pool == "prefill" else self.sim.system.decode_cost
            for _ in range(event.new - len(mine) - len(coming)):
                serving_at = float("inf") if self.rng.random() < self.world.never_start else now + self.world.startup_s
                self.starting.append((serving_at, Replica(self.next_index, pool, cost)))
                self.next_index += 1
        elif event.new < len(mine):
            candidates = sorted((r for r in mine if r.role == pool), key=lambda r: (r.in_flight, -r.index))
            victims = candidates[: min(len(mine) - max(event.new, 1), len(candidates))]  # never a lent replica
            self._set_routed(pool, [r for r in mine if r not in victims])
            self.leaving += victims

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

    def _sample(self, now: float) -> None:
        held = [r.home for r in self.reporting.values()] + [r.home for _, r in self.starting]
        counts = (len(self.sim.prefill), len(self.sim.decode), len(self.lent), len(self.starting), len(self.leaving))
        self.timeline.append(PoolSample(now, *counts, held.count("prefill"), held.count("decode")))

    def replica_seconds(self, end_s: float) -> dict[str, float]:
        """Replicas held x seconds per pool from 0 to ``end_s``, each sample holding until the next."""
        ends = [*(s.time_s for s in self.timeline[1:]), end_s]
        spans = [(s, max(min(until, end_s) - s.time_s, 0.0)) for s, until in zip(self.timeline, ends)]
        prefill, decode = sum(s.held_prefill * t for s, t in spans), sum(s.held_decode * t for s, t in spans)
        return {"prefill": prefill, "decode": decode}

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
