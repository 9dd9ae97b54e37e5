"""``decide(snapshot, policy, state) -> list[Action]``: the autoscaler's fast path, a pure
function (no Ray, no clock: the time is the snapshot's).

A prefill replica is **lent** to decode as ``both`` (it keeps taking prompts and starts
taking whole requests) when the decode pool is under pressure (any of its signals at
``enter``) while the prefill side is calm (every prefill signal at or below ``leave``). It
is **reclaimed** (back to ``prefill``: no new decode work at once, its decodes finish) when
prompts press again (any prefill signal at ``enter``) or the decode pressure is gone (every
decode signal at or below ``leave``). Decode demand is measured against the decode
deployment's own replicas, so the relief a lend brings does not read as the end of the
burst. Between the two thresholds nothing changes (hysteresis); after any lend or reclaim
nothing changes for ``cooldown_s``. A reclaimed replica is **drained** once its decodes
have ended, or after ``drain_timeout_s`` (they still finish); it is not lent again before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType

from autoscaling.policy import Band, Policy
from autoscaling.snapshot import ReplicaLoad, Snapshot
from engine.params import Role


class ActionKind(StrEnum):
    LEND = "lend"
    RECLAIM = "reclaim"
    DRAINED = "drained"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    replica: str
    reason: str

    @property
    def role(self) -> Role:
        """The role the replica is assigned by this action."""
        return Role.BOTH if self.kind is ActionKind.LEND else Role.PREFILL


@dataclass(frozen=True)
class ControllerState:
    """What the controller remembers between decisions (the snapshot may lag an assignment)."""

    lent: frozenset[str] = frozenset()
    draining: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))  # replica -> reclaimed at
    last_action_s: float | None = None

    def role_of(self, replica: ReplicaLoad) -> Role:
        """The role assigned to ``replica``."""
        return Role.BOTH if replica.replica in self.lent else replica.home

    def after(self, actions: Iterable[Action], now: float) -> ControllerState:
        lent, draining, last = set(self.lent), dict(self.draining), self.last_action_s
        for action in actions:
            if action.kind is ActionKind.LEND:
                lent.add(action.replica)
                last = now
            elif action.kind is ActionKind.RECLAIM:
                lent.discard(action.replica)
                draining[action.replica] = now
                last = now
            else:
                draining.pop(action.replica, None)
        return ControllerState(frozenset(lent), MappingProxyType(draining), last)

    def forget_missing(self, present: Iterable[str]) -> ControllerState:
        """Drop replicas that left (stopped, restarted under a new id)."""
        alive = set(present)
        draining = {r: t for r, t in self.draining.items() if r in alive}
        return replace(self, lent=self.lent & alive, draining=MappingProxyType(draining))


@dataclass(frozen=True)
class Signals:
    """The policy's signals, computed from one snapshot (None: not measurable now)."""

    kv_usage: float | None
    waiting: float | None
    running_per_replica: float | None
    tpot_slo_ratio: float | None
    queued_prompt_tokens: float | None
    ttft_slo_ratio: float | None

    @classmethod
    def of(cls, snapshot: Snapshot, policy: Policy, state: ControllerState) -> Signals:
        decode_home = [r for r in snapshot.replicas if r.home is Role.DECODE]
        decode_serving = [r for r in snapshot.replicas if state.role_of(r) in (Role.DECODE, Role.BOTH)]
        prefill_home = [r for r in snapshot.replicas if r.home is Role.PREFILL]
        home_blocks = sum(r.total_blocks for r in decode_home)
        observed = snapshot.observed
        return cls(
            kv_usage=sum(r.decode_blocks for r in decode_serving) / home_blocks if home_blocks else None,
            waiting=float(sum(r.waiting for r in decode_home)) if decode_home else None,
            running_per_replica=(sum(r.decoding for r in decode_serving) / len(decode_home) if decode_home else None),
            tpot_slo_ratio=_ratio(observed.tpot_p90_s, policy.slo.tpot_p90_ms),
            queued_prompt_tokens=(
                sum(r.queued_prompt_tokens for r in prefill_home) / len(prefill_home) if prefill_home else None
            ),
            ttft_slo_ratio=_ratio(observed.prefill_p90_s, policy.slo.ttft_p90_ms),
        )

    def decode_bands(self, policy: Policy) -> list[tuple[str, float | None, Band]]:
        p = policy.decode_pressure
        return [
            ("decode kv_usage", self.kv_usage, p.kv_usage),
            ("decode waiting", self.waiting, p.waiting),
            ("decode running_per_replica", self.running_per_replica, p.running_per_replica),
            ("tpot_slo_ratio", self.tpot_slo_ratio, p.tpot_slo_ratio),
        ]

    def prefill_bands(self, policy: Policy) -> list[tuple[str, float | None, Band]]:
        p = policy.prefill_pressure
        return [
            ("prefill queued_prompt_tokens", self.queued_prompt_tokens, p.queued_prompt_tokens),
            ("prefill ttft_slo_ratio", self.ttft_slo_ratio, p.ttft_slo_ratio),
        ]


def _ratio(seconds: float | None, slo_ms: float) -> float | None:
    return None if seconds is None else seconds * 1e3 / slo_ms


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}"


def _entered(bands: list[tuple[str, float | None, Band]]) -> list[str]:
    return [f"{name} {_fmt(v)} >= enter {_fmt(b.enter)}" for name, v, b in bands if b.entered(v)]


def _all_left(bands: list[tuple[str, float | None, Band]]) -> str | None:
    """A reason when every band is at or below its ``leave``; None otherwise, and None when no
    signal in use was measured (stale replicas are not calm ones)."""
    if not all(b.left(v) for _, v, b in bands):
        return None
    used = [f"{name} {_fmt(v)} <= leave {_fmt(b.leave)}" for name, v, b in bands if b.on and v is not None]
    if used:
        return ", ".join(used)
    return None if any(b.on for _, _, b in bands) else "no signal used"  # on but unmeasured: unknown


def _drained(snapshot: Snapshot, policy: Policy, state: ControllerState) -> list[Action]:
    loads = {r.replica: r for r in snapshot.replicas}
    actions = []
    for replica, since in sorted(state.draining.items()):
        load = loads.get(replica)
        if load is None:
            continue
        if load.decoding == 0 and load.role is Role.PREFILL:
            actions.append(Action(ActionKind.DRAINED, replica, "decoding 0: its decodes ended, prefill only"))
        elif snapshot.time - since >= policy.drain_timeout_s:
            reason = f"drain bound {policy.drain_timeout_s:g}s reached; {load.decoding} decodes still finishing there"
            actions.append(Action(ActionKind.DRAINED, replica, reason))
    return actions


def _reclaim(snapshot: Snapshot, signals: Signals, policy: Policy, state: ControllerState) -> Action | None:
    lent = [r for r in snapshot.replicas if r.replica in state.lent]
    if not lent:
        return None
    pressed = _entered(signals.prefill_bands(policy))
    if pressed:
        reason = "prompts press: " + ", ".join(pressed)
    else:
        calm = _all_left(signals.decode_bands(policy))
        if calm is None:
            return None
        reason = "decode burst over: " + calm
    victim = min(lent, key=lambda r: (r.decoding, r.replica))  # the quickest to drain
    return Action(ActionKind.RECLAIM, victim.replica, reason)


def _lend(snapshot: Snapshot, signals: Signals, policy: Policy, state: ControllerState) -> Action | None:
    pressed = _entered(signals.decode_bands(policy))
    if not pressed:
        return None
    prefill_calm = _all_left(signals.prefill_bands(policy))
    if prefill_calm is None or len(state.lent) >= policy.max_lent:
        return None
    decode_serving = sum(state.role_of(r) in (Role.DECODE, Role.BOTH) for r in snapshot.replicas)
    if decode_serving >= policy.replicas.decode.max:
        return None
    dedicated = [r for r in snapshot.replicas if r.home is Role.PREFILL and r.replica not in state.lent]
    if len(dedicated) <= policy.replicas.prefill.min:
        return None
    candidates = [r for r in dedicated if r.replica not in state.draining]
    if not candidates:
        return None
    chosen = min(candidates, key=lambda r: (r.queued_prompt_tokens, r.running, r.replica))
    return Action(
        ActionKind.LEND, chosen.replica, f"decode pressed: {', '.join(pressed)}; prefill calm: {prefill_calm}"
    )


def decide(snapshot: Snapshot, policy: Policy, state: ControllerState) -> list[Action]:
    """The actions to take now, each with the signal values that caused it."""
    actions = _drained(snapshot, policy, state)
    if state.last_action_s is not None and snapshot.time - state.last_action_s < policy.cooldown_s:
        return actions
    signals = Signals.of(snapshot, policy, state)
    move = _reclaim(snapshot, signals, policy, state) or _lend(snapshot, signals, policy, state)
    return [*actions, move] if move is not None else actions
