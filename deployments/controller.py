"""The autoscaler's controller: a small Serve deployment started with ``disagg_app``.

Mechanism: engine replicas **report** to it (``report``, every ``REPORT_PERIOD_S``) and get
their assigned role in the answer; the ingress **syncs** with it (``sync``), sending the
latencies it observed, the prompt tokens it admitted and its prefill-speed estimate, and
getting the routing plan (how many replicas serve each role); the
messages are ``autoscaling.messages``'. Serve has no call addressed to one replica, so the
assignment travels back on the replica's own call; a controller restart loses only the
lending state (replicas keep their roles until the new controller's first answer, which
returns each to its home role). Both calls come several times a second: the builder turns
Serve's access log off for this deployment (``deployments.build``), and what is logged here
is what changes: decisions, roles, errors.

Each ``interval_s`` it builds a ``Snapshot`` from the fresh reports and the window of
observations, runs ``decide`` (and ``decide_counts``) and applies the actions to its state;
every action is logged, counted (``tandem_autoscaler_actions_total``) and kept for
``GET /admin/autoscaler``. With ``autoscaling.record`` each snapshot is appended to a JSONL
trace for replay.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import asdict
from typing import Any

from app.settings import AppConfig
from autoscaling.decide import Action, ActionKind, ControllerState, decide
from autoscaling.messages import IngressReport, LatencySample, RelayedTargets, ReplicaReport, ReportAnswer, RoutingPlan
from autoscaling.routing import routing_plan
from autoscaling.scale import POOLS, ScaleEvent, ScaleState, decide_counts
from autoscaling.snapshot import Observed, PromptArrivals, ReplicaLoad, Snapshot
from deployments.background import keep_running
from deployments.metrics import AutoscalerMetrics

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log file, INFO included
MAX_DECISIONS = 100


def wall_clock(monotonic_s: float) -> float:
    """The wall-clock time of an instant of this process's monotonic clock."""
    return time.time() - (time.monotonic() - monotonic_s)


class AutoscalerController:
    def __init__(self, config: AppConfig) -> None:
        """``config``: the application's settings, validated once by the builder."""
        self.settings = config.autoscaling
        # each pool's GPUs per replica (ranks x GPUs per rank): scaling counts replicas, the view their GPUs
        self._gpus = {pool: config.pool(pool).tensor_parallel_size * config.pool(pool).num_gpus for pool in POOLS}
        self.policy = config.autoscaling.load(config.slo.ttft_ms, config.slo.tpot_ms)
        self.state = ControllerState()
        self.scaling = self.settings.replica_scaling and self.policy.scaling.enabled
        self.scale_state = ScaleState()
        self._relay: RelayedTargets | None = None  # the latest replica-count decision
        self._reports: dict[str, tuple[float, ReplicaLoad]] = {}  # replica -> (received at, load)
        self._samples: deque[tuple[float, LatencySample]] = deque()  # (received at, sample)
        self._arrivals = PromptArrivals(self.policy.window_s, started=time.monotonic())
        self._speeds: dict[str, float] = {}  # ingress (its report's sender) -> seconds per prompt token
        self._decisions: deque[dict[str, Any]] = deque(maxlen=MAX_DECISIONS)
        self._snapshot = Snapshot(time=time.monotonic())
        self._task: asyncio.Task | None = None
        self.metrics = AutoscalerMetrics()
        logger.info("autoscaler policy %r: %s", self.policy.name, self.policy.model_dump_json())

    # ---- calls from the replicas and the ingress -----------------------------------------

    async def report(self, report: ReplicaReport) -> ReportAnswer:
        """An engine replica's load; answers the role it must have and, with replica scaling,
        its pool's target for it to relay to Serve. A stopping replica is left out at once."""
        self._start()
        load = ReplicaLoad.of(report.replica, report.deployment, report.home, report.stats)
        if report.stopping:
            self._reports.pop(report.replica, None)
            return ReportAnswer(role=report.home)
        self._reports[report.replica] = (time.monotonic(), load)
        target = self._relay.for_pool(report.home) if self._relay is not None else None
        return ReportAnswer(role=self.state.role_of(load), target=target)

    async def sync(self, report: IngressReport, ingress: str = "") -> RoutingPlan:
        """What an ingress saw since its last sync (``ingress``: which one, for its prefill-speed
        estimate); answers the routing plan."""
        self._start()
        now = time.monotonic()
        self._samples.extend((now, sample) for sample in report.samples)
        self._arrivals.add(now, report.prompt_tokens)
        if report.seconds_per_prompt_token is not None:
            self._speeds[ingress] = report.seconds_per_prompt_token
        # from the latest reports, not the last tick's snapshot: a lent replica that reported
        # its new role is routed to within a report period, not an interval later
        current = Snapshot(time=now, replicas=self._fresh(now), observed=self._snapshot.observed)
        return routing_plan(current, self.state)

    async def view(self) -> dict[str, Any]:
        """``GET /admin/autoscaler``: the policy, each replica's role and load, the decisions."""
        self._start()
        snapshot = self._snapshot
        replicas = [
            {
                "deployment": r.deployment,
                "replica_id": r.replica,
                "role": r.role.value,
                "assigned_role": self.state.role_of(r).value,
                "draining": r.replica in self.state.draining,
                "load": {
                    "running": r.running,
                    "decoding": r.decoding,
                    "waiting": r.waiting,
                    "queued_prompt_tokens": r.queued_prompt_tokens,
                    "kv_usage": round(1 - r.free_blocks / r.total_blocks, 4) if r.total_blocks else None,
                },
            }
            for r in snapshot.replicas
        ]
        return {
            "enabled": True,
            "policy": self.policy.name,
            "slo": self.policy.slo.model_dump(),
            "interval_s": self.policy.interval_s,
            "replicas": replicas,
            "observed": asdict(snapshot.observed),
            "decisions": list(self._decisions),
            "scaling": self._scaling_view(snapshot),
        }

    def _scaling_view(self, snapshot: Snapshot) -> dict[str, Any]:
        scale = self.scale_state
        pools = {}
        for pool in POOLS:
            reporting = sum(r.home is pool for r in snapshot.replicas)
            target = scale.targets.get(pool)
            until = scale.backoff_until.get(pool)
            pools[pool.value] = {
                "target": target,
                "reporting": reporting,
                "pending": max((target or 0) - reporting, 0),
                "backoff_s": round(until - snapshot.time, 1) if until and until > snapshot.time else 0,
                "gpus_per_replica": self._gpus[pool],
                "target_gpus": None if target is None else target * self._gpus[pool],
            }
        return {"enabled": self.scaling, "pools": pools}

    # ---- the decision loop -----------------------------------------------------------------

    def _start(self) -> None:
        """The decision loop, started by the first call; in a context of its own, so its log
        lines carry no request id of the call that happened to start it."""
        self._task = keep_running(self._task, self._loop)

    async def _loop(self) -> None:
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # a bad tick must not end the loop
                logger.exception("autoscaler tick failed")
            await asyncio.sleep(self.policy.interval_s)

    def tick(self, now: float) -> list[Action]:
        snapshot = self._take_snapshot(now)
        present = {r.replica for r in snapshot.replicas}
        for replica in sorted(self.state.lent - present):  # silent: it returns home on its next report
            silent = Action(ActionKind.RECLAIM, replica, f"no report for over {self.policy.stale_after_s:g}s")
            self._record_action(now, silent)
        self.state = self.state.forget_missing(present)
        actions = decide(snapshot, self.policy, self.state)
        self.state = self.state.after(actions, now)
        for action in actions:
            self._record_action(now, action)
        self.metrics.roles(snapshot.replicas, self.state)
        if self.scaling:
            self._scale(snapshot)
        if self.settings.record:
            with open(self.settings.record, "a") as trace:
                trace.write(json.dumps(snapshot.to_json()) + "\n")
        return actions

    def _scale(self, snapshot: Snapshot) -> None:
        """Both pools' replica counts from the same snapshot; the targets go back to the
        replicas in their report answers, which relay them to Serve."""
        before = dict(self.scale_state.targets)
        self.scale_state, events = decide_counts(snapshot, self.policy, self.scale_state, self.state.lent)
        for event in events:
            self._record_scale(snapshot.time, event)
        scale = self.scale_state
        if dict(scale.targets) != before and scale.decided_at is not None:
            self._relay = RelayedTargets.of(scale.targets, seq=wall_clock(scale.decided_at))
        reporting = {pool: sum(r.home is pool for r in snapshot.replicas) for pool in POOLS}
        self.metrics.scaling(scale.targets, reporting)

    def _record_scale(self, now: float, event: ScaleEvent) -> None:
        logger.info("autoscaler %s %s: %s", event.kind.value, event.pool.value, event.reason)
        self.metrics.action(event.kind.value)
        self._decisions.append(
            {
                "time": time.time(),
                "monotonic_s": round(now, 3),
                "action": event.kind.value,
                "replica": None,
                "role": event.pool.value,
                "pool": event.pool.value,
                "replicas": [event.old, event.new],
                "reason": event.reason,
            }
        )

    def _fresh(self, now: float) -> tuple[ReplicaLoad, ...]:
        """The replicas that reported within ``stale_after_s``, in a stable order."""
        fresh = [load for seen, load in self._reports.values() if now - seen <= self.policy.stale_after_s]
        return tuple(sorted(fresh, key=lambda r: (r.deployment, r.replica)))

    def _take_snapshot(self, now: float) -> Snapshot:
        replicas = self._fresh(now)
        stale_after_s = self.policy.stale_after_s
        self._reports = {k: (seen, load) for k, (seen, load) in self._reports.items() if now - seen <= stale_after_s}
        while self._samples and now - self._samples[0][0] > self.policy.window_s:  # the oldest first
            self._samples.popleft()
        speed = min(self._speeds.values(), default=None)
        samples = [sample for _, sample in self._samples]
        observed = Observed.of(samples, self.policy.min_samples, self._arrivals.rate(now), speed)
        self._snapshot = Snapshot(time=now, replicas=replicas, observed=observed)
        return self._snapshot

    def _record_action(self, now: float, action: Action) -> None:
        logger.info("autoscaler %s %s: %s", action.kind.value, action.replica, action.reason)
        self.metrics.action(action.kind.value)
        self._decisions.append(
            {
                "time": time.time(),
                "monotonic_s": round(now, 3),
                "action": action.kind.value,
                "replica": action.replica,
                "role": action.role.value,
                "reason": action.reason,
            }
        )
