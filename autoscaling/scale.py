"""``decide_counts(snapshot, policy, state, lent) -> (state, events)``: the autoscaler's slow
path, the replica counts of both pools, a pure function (no Ray, no clock: the time is the
snapshot's).

One decision for both pools, from the same snapshot as lending, **counted by role**: the
decode load is every decoding request, including those a lent prefill replica carries, so a
burst that lending absorbs still grows the decode pool, and the lent replica goes home once
the new replicas take the load (the fast path bridges the minutes a new replica takes).

Per pool, the replicas the load needs at the policy's targets (``scaling.decode``:
decoding requests per replica, KV usage; ``scaling.prefill``: queued prompt tokens per
replica, and the share of a replica busy with the prompts arriving) is compared with the
pool's target:

- **up** to what the load needs (at most ``max_replicas``) once the need has lasted
  ``scale_up_delay_s``;
- **down** once the load would stay under ``scale_down_below`` of the targets on one replica
  fewer for ``scale_down_delay_s`` (the gap between the two thresholds is the hysteresis), to
  the fewest replicas that kept it under that share at every decision of that time (the
  surplus goes in one decision, not one replica per delay, and a momentary trough does not
  size it); the prefill pool does not shrink while one of its replicas is lent
  (the fast path reclaims it first);
- **give up**: replicas asked for that do not report within ``pending_timeout_s`` (a pod
  left Pending, no room for the replica) are given up: the target falls back to the
  replicas that report, and that pool asks again only after a back-off that doubles up to
  ``max_backoff_s`` (reset once a scale-up is met), so the decision never stays stuck.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType

from autoscaling.policy import Policy
from autoscaling.snapshot import Snapshot
from engine.params import Role

POOLS = (Role.PREFILL, Role.DECODE)


class ScaleKind(StrEnum):
    UP = "scale_up"
    DOWN = "scale_down"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class ScaleEvent:
    pool: Role
    kind: ScaleKind
    old: int
    new: int
    reason: str


def _frozen(mapping: dict) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class ScaleState:
    """Between decisions: each pool's target (absent until its replicas first report, so a
    restarted controller starts from what runs), the need being timed, pending replicas and
    back-off."""

    targets: Mapping[Role, int] = field(default_factory=lambda: _frozen({}))
    # kind, since, the largest count the load needed since then (a shrink goes no lower)
    want: Mapping[Role, tuple[ScaleKind, float, int]] = field(default_factory=lambda: _frozen({}))
    pending_since: Mapping[Role, float] = field(default_factory=lambda: _frozen({}))
    backoff_until: Mapping[Role, float] = field(default_factory=lambda: _frozen({}))
    backoff_s: Mapping[Role, float] = field(default_factory=lambda: _frozen({}))
    # the snapshot time (the controller's clock) of the last change of any target, the first
    # targets included; the controller relays each change with this instant on the wall clock
    # (``autoscaling.messages.RelayedTargets.seq``)
    decided_at: float | None = None

    def with_pool(self, pool: Role, **changes: object) -> ScaleState:
        """This state with ``changes`` (field -> value for ``pool``, None removes it)."""
        updated = {}
        for name, value in changes.items():
            entries = dict(getattr(self, name))
            if value is None:
                entries.pop(pool, None)
            else:
                entries[pool] = value
            updated[name] = _frozen(entries)
        return replace(self, **updated)


@dataclass(frozen=True)
class PoolLoad:
    """One pool's load at the snapshot, and the replicas it needs (None: no signal is on)."""

    reporting: int
    needed: int | None
    down_to: int  # the fewest replicas that keep the load under scale_down_below of every target
    detail: str

    @property
    def down_ok(self) -> bool:
        """One replica fewer would stay under scale_down_below of every target."""
        return self.down_to < self.reporting


def _needed(amounts: list[tuple[str, float | None, float | None]], reporting: int, below: float) -> PoolLoad:
    """``amounts``: (what, total load or None when unknown, per-replica target or None when off)."""
    used = [(what, total, target) for what, total, target in amounts if target is not None and total is not None]
    if not used:
        return PoolLoad(reporting, None, reporting, "no scaling signal on")

    def fewest(share: float) -> int:
        return max(max(math.ceil(total / (share * target) - 1e-9) for _, total, target in used), 1)

    detail = ", ".join(f"{what} {total:g} (target {target:g} per replica)" for what, total, target in used)
    return PoolLoad(reporting, fewest(1.0), fewest(below), f"{detail} on {reporting} replica(s)")


def pool_load(pool: Role, snapshot: Snapshot, policy: Policy) -> PoolLoad:
    scaling, replicas = policy.scaling, snapshot.replicas
    own = [r for r in replicas if r.home is pool]
    if pool is Role.PREFILL:
        queued = sum(r.queued_prompt_tokens for r in replicas if r.serves_prefill)
        work = snapshot.observed.prompt_work
        work = None if work is None else round(work, 3)
        amounts = [
            ("queued prompt tokens", queued, scaling.prefill.queued_prompt_tokens),
            ("prompt work (busy replicas' worth)", work, scaling.prefill.busy_share),
        ]
        return _needed(amounts, len(own), scaling.scale_down_below)
    decoding = sum(r.decoding for r in replicas if r.serves_decode)  # by role: lent replicas' too
    blocks_per_replica = max((r.total_blocks for r in own), default=0)
    kv_target = scaling.decode.kv_usage
    amounts: list[tuple[str, float | None, float | None]] = [
        ("decoding requests", decoding, scaling.decode.running_per_replica)
    ]
    if blocks_per_replica and kv_target is not None:
        used_share = sum(r.decode_blocks for r in replicas if r.serves_decode) / blocks_per_replica
        amounts.append(("KV in use (replicas' worth of blocks)", round(used_share, 3), kv_target))
    return _needed(amounts, len(own), scaling.scale_down_below)


def decide_counts(
    snapshot: Snapshot, policy: Policy, state: ScaleState, lent: frozenset[str] = frozenset()
) -> tuple[ScaleState, list[ScaleEvent]]:
    """Both pools' targets from one snapshot; ``lent``: the replicas the fast path lent."""
    events: list[ScaleEvent] = []
    if not policy.scaling.enabled:
        return state, events
    for pool in POOLS:
        load = pool_load(pool, snapshot, policy)
        if load.reporting == 0:
            continue  # nothing reports yet (starting, or a controller restart): hold
        any_lent = any(r.replica in lent for r in snapshot.replicas if r.home is pool)
        before = state.targets.get(pool)
        state, event = _decide_pool(pool, load, policy, state, snapshot.time, any_lent)
        if event is not None:
            events.append(event)
        if state.targets.get(pool) != before:
            state = replace(state, decided_at=snapshot.time)
    return state, events


def _decide_pool(
    pool: Role, load: PoolLoad, policy: Policy, state: ScaleState, now: float, any_lent: bool
) -> tuple[ScaleState, ScaleEvent | None]:
    bounds = policy.scaling.pool(pool)
    if pool not in state.targets:
        first = min(max(load.reporting, bounds.min_replicas), bounds.max_replicas)
        state = state.with_pool(pool, targets=first)
    target = state.targets[pool]
    if load.reporting < target:
        return _pending(pool, load, policy, state, now)
    if pool in state.pending_since:  # the replicas asked for arrived: the next give-up starts over
        state = state.with_pool(pool, pending_since=None, backoff_s=None)
    return _grow_or_shrink(pool, load, policy, state, now, any_lent)


def _pending(
    pool: Role, load: PoolLoad, policy: Policy, state: ScaleState, now: float
) -> tuple[ScaleState, ScaleEvent | None]:
    """Replicas asked for that do not report yet: wait up to ``pending_timeout_s``, then give
    them up and back off."""
    scaling = policy.scaling
    since = state.pending_since.get(pool, now)
    state = state.with_pool(pool, pending_since=since, want=None)
    if now - since < scaling.pending_timeout_s:
        return state, None
    target = state.targets[pool]
    new = max(load.reporting, policy.scaling.pool(pool).min_replicas)
    backoff = min(max(state.backoff_s.get(pool, 0) * 2, scaling.pending_timeout_s), scaling.max_backoff_s)
    state = state.with_pool(pool, targets=new, pending_since=None, backoff_until=now + backoff, backoff_s=backoff)
    reason = (
        f"{target - load.reporting} replica(s) asked for {now - since:.0f}s ago never reported"
        f" (no room for them?): target back to {new}, no scale-up for {backoff:g}s"
    )
    return state, ScaleEvent(pool, ScaleKind.GIVE_UP, target, new, reason)


def _grow_or_shrink(
    pool: Role, load: PoolLoad, policy: Policy, state: ScaleState, now: float, any_lent: bool
) -> tuple[ScaleState, ScaleEvent | None]:
    scaling, bounds, target = policy.scaling, policy.scaling.pool(pool), state.targets[pool]
    if load.needed is None:
        return state.with_pool(pool, want=None), None
    wanted = state.want.get(pool)
    kind, new, why = None, target, ""
    if load.needed > target and target < bounds.max_replicas:
        if now < state.backoff_until.get(pool, now):
            return state.with_pool(pool, want=None), None
        kind, new, delay = ScaleKind.UP, min(load.needed, bounds.max_replicas), scaling.scale_up_delay_s
        why = f"needs {load.needed} (max {bounds.max_replicas})"
    elif load.down_ok and max(load.down_to, bounds.min_replicas) < target and not any_lent:
        kind, delay = ScaleKind.DOWN, scaling.scale_down_delay_s
        seen = wanted[2] if wanted is not None and wanted[0] is kind else 0
        new = max(load.down_to, seen, bounds.min_replicas)
        why = f"under {scaling.scale_down_below:g} of the targets on {new} (min {bounds.min_replicas})"
    if kind is None:
        return state.with_pool(pool, want=None), None
    since = wanted[1] if wanted is not None and wanted[0] is kind else now
    if now - since < delay:
        return state.with_pool(pool, want=(kind, since, new)), None
    state = state.with_pool(pool, targets=new, want=None)
    reason = f"{pool.value}: {load.detail}: {why}, for {now - since:.0f}s: {target} -> {new}"
    return state, ScaleEvent(pool, kind, target, new, reason)
