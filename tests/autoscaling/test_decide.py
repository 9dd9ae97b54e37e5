"""``decide``: lend, reclaim and drained decisions on hand-built snapshots (pure, no Ray).

The default app is one ``PrefillServer`` replica ``p0`` and one ``DecodeServer`` replica
``d0``; the 2+1 and 3+1 cases add ``p1`` / ``p2``. Each test states its policy in full, so
a change to the shipped YAMLs does not move these thresholds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autoscaling.decide import Action, ActionKind, ControllerState, Signals, decide
from autoscaling.policy import Policy, load_policy
from autoscaling.snapshot import Observed, ReplicaLoad, Snapshot
from engine.params import Role
from tests.autoscaling.loads import replica_load as _replica


def _policy(**fields: Any) -> Policy:
    """Thresholds like the default policy's, no cooldown unless asked; ``fields`` replace top-level ones."""
    data: dict[str, Any] = {
        "name": "test",
        "slo": {"ttft_p90_ms": 1000, "tpot_p90_ms": 100},
        "interval_s": 1,
        "cooldown_s": 0,
        "window_s": 10,
        "stale_after_s": 5,
        "max_lent": 1,
        "drain_timeout_s": 30,
        "replicas": {"prefill": {"min": 0, "max": 8}, "decode": {"min": 1, "max": 8}},
        "decode_pressure": {
            "kv_usage": {"enter": 0.75, "leave": 0.4},
            "waiting": {"enter": 2, "leave": 0},
            "running_per_replica": {"enter": 6, "leave": 2},
        },
        "prefill_pressure": {"queued_prompt_tokens": {"enter": 1000, "leave": 200}},
    }
    data.update(fields)
    return Policy.model_validate(data)


def _bounds(prefill_min: int = 0, decode_max: int = 8) -> dict[str, Any]:
    return {"prefill": {"min": prefill_min, "max": 8}, "decode": {"min": 1, "max": decode_max}}


def _snap(time: float, *replicas: ReplicaLoad, observed: Observed | None = None) -> Snapshot:
    return Snapshot(time=time, replicas=replicas, observed=observed or Observed())


def _run(
    snapshots: Iterable[Snapshot], policy: Policy, state: ControllerState | None = None
) -> tuple[list[tuple[float, Action]], ControllerState]:
    """What the controller does each interval: forget vanished replicas, decide, remember."""
    state, decisions = state or ControllerState(), []
    for snapshot in snapshots:
        state = state.forget_missing(r.replica for r in snapshot.replicas)
        actions = decide(snapshot, policy, state)
        state = state.after(actions, snapshot.time)
        decisions.extend((snapshot.time, action) for action in actions)
    return decisions, state


def _kinds(decisions: list[tuple[float, Action]]) -> list[tuple[float, ActionKind, str]]:
    return [(t, a.kind, a.replica) for t, a in decisions]


LENT_P0 = ControllerState(lent=frozenset({"p0"}), last_action_s=0.0)


# --- lend --------------------------------------------------------------------------------


def test_decode_burst_lends_the_calm_prefill_replica_naming_the_signal():
    snapshot = _snap(10.0, _replica("p0"), _replica("d0", decoding=3, waiting=5, used_blocks=30))
    actions = decide(snapshot, _policy(), ControllerState())
    assert actions == [
        Action(
            ActionKind.LEND,
            "p0",
            "decode pressed: decode waiting 5.00 >= enter 2.00; "
            "prefill calm: prefill queued_prompt_tokens 0.00 <= leave 200",
        )
    ]
    assert actions[0].role is Role.BOTH
    state = ControllerState().after(actions, snapshot.time)
    assert state.lent == frozenset({"p0"}) and state.last_action_s == 10.0 and not state.draining


def test_every_decode_signal_that_entered_is_named():
    snapshot = _snap(0.0, _replica("p0", queued=100), _replica("d0", decoding=7, waiting=2, used_blocks=80))
    [action] = decide(snapshot, _policy(), ControllerState())
    assert action.kind is ActionKind.LEND
    assert action.reason == (
        "decode pressed: decode kv_usage 0.80 >= enter 0.75, decode waiting 2.00 >= enter 2.00, "
        "decode running_per_replica 7.00 >= enter 6.00; prefill calm: prefill queued_prompt_tokens 100 <= leave 200"
    )


def test_observed_tpot_over_the_slo_lends_under_latency_first():
    policy = load_policy("latency_first")  # tpot_p90_ms 100, tpot_slo_ratio enter 0.9
    observed = Observed(num_requests=20, ttft_p90_s=0.3, tpot_p90_s=0.12, prefill_p90_s=0.2)
    snapshot = _snap(0.0, _replica("p0"), _replica("d0", decoding=1), observed=observed)
    [action] = decide(snapshot, policy, ControllerState())
    assert (action.kind, action.replica) == (ActionKind.LEND, "p0")
    assert "tpot_slo_ratio 1.20 >= enter 0.90" in action.reason
    assert "prefill ttft_slo_ratio 0.10 <= leave 0.30" in action.reason


def test_two_prefill_replicas_the_least_queued_is_lent():
    snapshot = _snap(0.0, _replica("p0", queued=300), _replica("p1", queued=50), _replica("d0", waiting=4))
    [action] = decide(snapshot, _policy(), ControllerState())
    assert (action.kind, action.replica, action.role) == (ActionKind.LEND, "p1", Role.BOTH)
    assert action.reason.endswith("prefill calm: prefill queued_prompt_tokens 175 <= leave 200")


def test_no_lend_while_prefill_is_not_calm():
    # queued 500 per prefill replica: below enter (1000) but above leave (200)
    snapshot = _snap(0.0, _replica("p0", queued=500), _replica("d0", waiting=9, decoding=9))
    assert decide(snapshot, _policy(), ControllerState()) == []


def test_no_lend_without_decode_pressure():
    snapshot = _snap(0.0, _replica("p0"), _replica("d0", waiting=1, decoding=5, used_blocks=74))
    assert decide(snapshot, _policy(), ControllerState()) == []


# --- reclaim -----------------------------------------------------------------------------


def test_prompt_surge_reclaims_the_lent_replica_even_under_decode_pressure():
    snapshot = _snap(5.0, _replica("p0", Role.BOTH, queued=1500, decoding=2), _replica("d0", waiting=5, decoding=8))
    [action] = decide(snapshot, _policy(), LENT_P0)
    assert action == Action(ActionKind.RECLAIM, "p0", "prompts press: prefill queued_prompt_tokens 1500 >= enter 1000")
    assert action.role is Role.PREFILL
    state = LENT_P0.after([action], snapshot.time)
    assert state.lent == frozenset() and dict(state.draining) == {"p0": 5.0} and state.last_action_s == 5.0


def test_observed_prefill_latency_over_the_slo_reclaims():
    policy = _policy(prefill_pressure={"ttft_slo_ratio": {"enter": 0.8, "leave": 0.4}})
    observed = Observed(num_requests=10, ttft_p90_s=1.0, tpot_p90_s=0.05, prefill_p90_s=0.9)
    snapshot = _snap(5.0, _replica("p0", Role.BOTH), _replica("d0", waiting=5), observed=observed)
    [action] = decide(snapshot, policy, LENT_P0)
    assert action == Action(ActionKind.RECLAIM, "p0", "prompts press: prefill ttft_slo_ratio 0.90 >= enter 0.80")


def test_burst_over_reclaims_when_every_decode_signal_is_at_or_below_leave():
    snapshot = _snap(
        5.0, _replica("p0", Role.BOTH, decoding=1, used_blocks=5), _replica("d0", decoding=1, used_blocks=5)
    )
    [action] = decide(snapshot, _policy(), LENT_P0)
    assert (action.kind, action.replica) == (ActionKind.RECLAIM, "p0")
    assert action.reason.startswith("decode burst over")
    assert action.reason == (
        "decode burst over: decode kv_usage 0.10 <= leave 0.40, decode waiting 0.00 <= leave 0.00, "
        "decode running_per_replica 2.00 <= leave 2.00"
    )


def test_one_signal_above_leave_keeps_the_replica_lent():
    # running 2 per decode replica and no waiting are calm, but KV (0.5) is above leave (0.4)
    snapshot = _snap(5.0, _replica("p0", Role.BOTH, decoding=1), _replica("d0", decoding=1, used_blocks=50))
    assert decide(snapshot, _policy(), LENT_P0) == []


def test_the_lent_replica_quickest_to_drain_is_reclaimed_first():
    policy = _policy(max_lent=2)
    state = ControllerState(lent=frozenset({"p0", "p1"}), last_action_s=0.0)
    calm = [
        _snap(t, _replica("p0", Role.BOTH, decoding=1), _replica("p1", Role.BOTH), _replica("d0"))
        for t in (1.0, 2.0, 3.0)
    ]
    decisions, state = _run(calm, policy, state)
    assert _kinds(decisions) == [(1.0, ActionKind.RECLAIM, "p1"), (2.0, ActionKind.RECLAIM, "p0")]
    assert state.lent == frozenset() and dict(state.draining) == {"p0": 2.0, "p1": 1.0}


# --- hysteresis --------------------------------------------------------------------------


def test_a_signal_between_leave_and_enter_never_acts_again_after_a_lend():
    policy = _policy(max_lent=8)
    burst = _snap(0.0, _replica("p0"), _replica("p1"), _replica("p2"), _replica("d0", used_blocks=80))
    middle = [
        _snap(t, _replica("p0", Role.BOTH), _replica("p1"), _replica("p2"), _replica("d0", used_blocks=used))
        for t, used in zip(range(1, 101), [50, 70] * 50)
    ]
    decisions, state = _run([burst, *middle], policy)
    assert _kinds(decisions) == [(0.0, ActionKind.LEND, "p0")]
    assert "decode kv_usage 0.80 >= enter 0.75" in decisions[0][1].reason
    assert state.lent == frozenset({"p0"})


def test_a_signal_just_below_enter_never_lends():
    snapshots = [
        _snap(t, _replica("p0"), _replica("d0", used_blocks=used, decoding=5, waiting=1))
        for t, used in zip(range(100), [74, 70, 60, 74] * 25)
    ]
    decisions, state = _run(snapshots, _policy())
    assert decisions == [] and state == ControllerState()


# --- bounds ------------------------------------------------------------------------------


def _bursts(times: Iterable[float], *prefill: str) -> list[Snapshot]:
    """Decode under pressure at each time; the prefill replicas report their home role."""
    return [_snap(t, *(_replica(p) for p in prefill), _replica("d0", waiting=5)) for t in times]


def test_min_prefill_replicas_are_never_lent():
    policy = _policy(max_lent=8, replicas=_bounds(prefill_min=1))
    decisions, state = _run(_bursts(range(20), "p0"), policy)
    assert decisions == [] and state.lent == frozenset()


def test_min_prefill_replicas_kept_with_two_of_them():
    policy = _policy(max_lent=8, replicas=_bounds(prefill_min=1))
    decisions, state = _run(_bursts(range(20), "p0", "p1"), policy)
    assert _kinds(decisions) == [(0, ActionKind.LEND, "p0")]
    assert state.lent == frozenset({"p0"})


def test_max_lent_is_respected():
    policy = _policy(max_lent=2)
    decisions, state = _run(_bursts(range(20), "p0", "p1", "p2"), policy)
    assert _kinds(decisions) == [(0, ActionKind.LEND, "p0"), (1, ActionKind.LEND, "p1")]
    assert state.lent == frozenset({"p0", "p1"})


def test_max_lent_zero_never_lends():
    decisions, _ = _run(_bursts(range(5), "p0", "p1"), _policy(max_lent=0))
    assert decisions == []


def test_decode_max_counts_lent_replicas():
    decisions, state = _run(_bursts(range(20), "p0", "p1", "p2"), _policy(max_lent=8, replicas=_bounds(decode_max=2)))
    assert _kinds(decisions) == [(0, ActionKind.LEND, "p0")]
    decisions, _ = _run(_bursts(range(5), "p0", "p1"), _policy(max_lent=8, replicas=_bounds(decode_max=1)))
    assert decisions == []


# --- cooldown ----------------------------------------------------------------------------


def test_no_lend_or_reclaim_within_the_cooldown():
    policy = _policy(cooldown_s=5)
    burst = _snap(0.0, _replica("p0"), _replica("p1"), _replica("d0", waiting=5))
    calm = [_snap(t, _replica("p0", Role.BOTH), _replica("p1"), _replica("d0")) for t in (1.0, 4.9, 5.0)]
    # p0 still decoding after its reclaim (not drained), p1 home; decode pressed again
    again = [_snap(t, _replica("p0", decoding=2), _replica("p1"), _replica("d0", waiting=5)) for t in (6.0, 9.9, 10.0)]
    decisions, state = _run([burst, *calm, *again], policy)
    assert _kinds(decisions) == [
        (0.0, ActionKind.LEND, "p0"),
        (5.0, ActionKind.RECLAIM, "p0"),
        (10.0, ActionKind.LEND, "p1"),
    ]
    assert state.lent == frozenset({"p1"}) and dict(state.draining) == {"p0": 5.0} and state.last_action_s == 10.0


# --- drained -----------------------------------------------------------------------------


def test_drained_once_the_replica_reports_prefill_with_no_decodes():
    policy = _policy(max_lent=1)
    state = ControllerState(draining={"p0": 0.0}, last_action_s=0.0)
    snapshots = [
        _snap(1.0, _replica("p0", Role.BOTH), _replica("d0", waiting=5)),  # its role change not reported yet
        _snap(2.0, _replica("p0", Role.PREFILL, decoding=2), _replica("d0", waiting=5)),  # decodes finishing
        _snap(3.0, _replica("p0", Role.PREFILL), _replica("d0", waiting=5)),
        _snap(4.0, _replica("p0", Role.PREFILL), _replica("d0", waiting=5)),
    ]
    decisions, state = _run(snapshots, policy, state)
    # not lent again while draining (the only candidate); lent the interval after it drained
    assert _kinds(decisions) == [(3.0, ActionKind.DRAINED, "p0"), (4.0, ActionKind.LEND, "p0")]
    assert decisions[0][1].reason == "decoding 0: its decodes ended, prefill only"
    assert state.lent == frozenset({"p0"}) and not state.draining


def test_drained_after_the_drain_bound_with_decodes_still_running():
    policy = _policy(drain_timeout_s=30)
    state = ControllerState(draining={"p0": 10.0}, last_action_s=10.0)
    snapshots = [_snap(t, _replica("p0", Role.PREFILL, decoding=3), _replica("d0")) for t in (20.0, 39.9, 40.0)]
    decisions, state = _run(snapshots, policy, state)
    assert _kinds(decisions) == [(40.0, ActionKind.DRAINED, "p0")]
    assert decisions[0][1].reason == "drain bound 30s reached; 3 decodes still finishing there"
    assert not state.draining


def test_drained_is_reported_during_the_cooldown():
    policy = _policy(cooldown_s=60)
    state = ControllerState(draining={"p0": 0.0}, last_action_s=0.0)
    actions = decide(_snap(1.0, _replica("p0"), _replica("d0", waiting=5)), policy, state)
    assert [(a.kind, a.replica) for a in actions] == [(ActionKind.DRAINED, "p0")]


# --- demand against the decode deployment ------------------------------------------------


def test_relief_from_a_lend_does_not_read_as_the_end_of_the_burst():
    policy = _policy()
    burst = _snap(0.0, _replica("p0"), _replica("d0", decoding=8, used_blocks=60))
    split = [
        _snap(t, _replica("p0", Role.BOTH, decoding=4, used_blocks=30), _replica("d0", decoding=4, used_blocks=30))
        for t in range(1, 30)
    ]
    decisions, state = _run([burst, *split], policy)
    assert _kinds(decisions) == [(0.0, ActionKind.LEND, "p0")]
    assert state.lent == frozenset({"p0"})
    signals = Signals.of(split[0], policy, state)
    assert signals.running_per_replica == 8.0 and signals.kv_usage == 0.6


def test_a_lent_replicas_pinned_prompt_blocks_are_not_decode_demand():
    snapshot = _snap(
        0.0, _replica("p0", Role.BOTH, used_blocks=20, pinned_blocks=70), _replica("d0", used_blocks=10, waiting=3)
    )
    signals = Signals.of(snapshot, _policy(), LENT_P0)
    assert signals.kv_usage == 0.3 and signals.waiting == 3.0 and signals.queued_prompt_tokens == 0.0
    assert Signals.of(snapshot, _policy(), ControllerState()).kv_usage == 0.1  # not lent: p0's blocks are prefill's


# --- replicas that leave -----------------------------------------------------------------


def test_forget_missing_drops_replicas_that_left():
    state = ControllerState(lent=frozenset({"p0", "p1"}), draining={"p2": 3.0, "p3": 4.0}, last_action_s=4.0)
    forgotten = state.forget_missing(["p1", "p3", "d0"])
    assert forgotten.lent == frozenset({"p1"})
    assert dict(forgotten.draining) == {"p3": 4.0}
    assert forgotten.last_action_s == 4.0


def test_a_lent_replica_that_vanished_frees_its_place():
    burst = _snap(0.0, _replica("p0"), _replica("d0", waiting=5))
    restarted = [_snap(t, _replica("p0b"), _replica("d0", waiting=5)) for t in (1.0, 2.0)]
    decisions, state = _run([burst, *restarted], _policy(max_lent=1))
    assert _kinds(decisions) == [(0.0, ActionKind.LEND, "p0"), (1.0, ActionKind.LEND, "p0b")]
    assert state.lent == frozenset({"p0b"})
