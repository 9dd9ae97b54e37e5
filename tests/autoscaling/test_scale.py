"""Replica counts of both pools (``autoscaling/scale.py``) and Serve's policy functions that
follow them (``autoscaling/serve_policy.py``), on synthetic snapshots and on Serve's own
``AutoscalingContext`` wrapped as Serve wraps a custom policy (min/max applied on top)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config, _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from app.settings import AppConfig
from autoscaling.policy import Policy, PolicyError, load_policy
from autoscaling.replay import main, replay
from autoscaling.scale import ScaleKind, ScaleState, decide_counts
from autoscaling.serve_policy import (
    SEQ_METRIC,
    TARGET_METRIC,
    follow_decision,
    follow_decisions,
    serve_autoscaling_config,
)
from autoscaling.snapshot import Observed, PromptArrivals, ReplicaLoad, Snapshot
from engine.params import Role
from tests.autoscaling.loads import replica_load


def _replica(name: str, home: Role, *, decoding: int = 0, queued: int = 0, role: Role | None = None) -> ReplicaLoad:
    """``p*`` replicas are PrefillServer's, ``d*`` DecodeServer's (``home`` says which, for the reader)."""
    assert (home is Role.PREFILL) == name.startswith("p")
    return replica_load(name, role, decoding=decoding, queued=queued, total_blocks=1000)


def _pools(t: float, prefill: int, decode: int, decoding: int = 0, queued: int = 0) -> Snapshot:
    """``prefill`` + ``decode`` replicas reporting, the load spread over each pool."""
    replicas = [_replica(f"p{i}", Role.PREFILL, queued=queued // prefill if i == 0 else 0) for i in range(prefill)]
    replicas += [_replica(f"d{i}", Role.DECODE, decoding=decoding // decode if i == 0 else 0) for i in range(decode)]
    return Snapshot(time=t, replicas=tuple(replicas))


@pytest.fixture
def policy() -> Policy:
    return load_policy("default")  # decode: 6 per replica, up after 10 s, down after 30 s below 0.5


def _run(policy: Policy, snapshots, state: ScaleState | None = None, lent=frozenset()):
    state, events = state or ScaleState(), []
    for snapshot in snapshots:
        state, new = decide_counts(snapshot, policy, state, lent)
        events += [(snapshot.time, e) for e in new]
    return state, events


def test_a_sustained_decode_load_raises_the_count_after_the_delay_up_to_max(policy):
    # 40 decoding on 1 replica: needs 7 at 6 per replica; max 4; the need must last 10 s
    state, events = _run(policy, [_pools(t, 1, 1, decoding=40) for t in range(0, 12)])
    assert [(t, e.kind, e.pool, e.old, e.new) for t, e in events] == [(10, ScaleKind.UP, Role.DECODE, 1, 4)]
    assert state.targets == {Role.PREFILL: 1, Role.DECODE: 4}
    assert "needs 7 (max 4)" in events[0][1].reason


def test_a_short_burst_changes_nothing(policy):
    snapshots = [_pools(t, 1, 1, decoding=40 if t < 9 else 2) for t in range(0, 30)]
    assert _run(policy, snapshots)[1] == []


def test_the_count_falls_after_the_delay_to_what_the_load_needs_in_one_step_never_below_min(policy):
    state = ScaleState().with_pool(Role.DECODE, targets=3).with_pool(Role.PREFILL, targets=1)
    state, events = _run(policy, [_pools(t, 1, 3, decoding=1) for t in range(0, 100)], state)
    assert [(t, e.kind, e.old, e.new) for t, e in events] == [(30, ScaleKind.DOWN, 3, 1)]  # 30 s of surplus
    assert state.targets[Role.DECODE] == 1  # min_replicas
    # 7 decoding on 4: at 6 per replica and 0.5 of it, the fewest that stay under are 3, not 1
    state = ScaleState().with_pool(Role.DECODE, targets=4).with_pool(Role.PREFILL, targets=1)
    state, events = _run(policy, [_pools(t, 1, 4, decoding=28) for t in range(0, 100)], state)  # 7 on d0
    assert [(t, e.kind, e.old, e.new) for t, e in events] == [(30, ScaleKind.DOWN, 4, 3)]
    assert "under 0.5 of the targets on 3" in events[0][1].reason


def test_a_load_around_a_threshold_never_flaps(policy):
    """12 on 2 replicas is the target; 7..12 stays between the scale-down (<= 3 on one fewer)
    and scale-up (> 12) thresholds: nothing moves; 13 and 6 alternating moves nothing either."""
    state = ScaleState().with_pool(Role.DECODE, targets=2).with_pool(Role.PREFILL, targets=1)
    steady = [_pools(t, 1, 2, decoding=7 + t % 6) for t in range(0, 200)]
    assert _run(policy, steady, state)[1] == []
    alternating = [_pools(t, 1, 2, decoding=13 if t % 2 else 6) for t in range(0, 200)]
    assert _run(policy, alternating, state)[1] == []


def test_both_pools_come_from_one_decision(policy):
    """One snapshot where prompts queue and decodes pile up: both pools move in the same call."""
    snapshots = [_pools(t, 1, 1, decoding=20, queued=3000) for t in range(0, 11)]
    state, events = _run(policy, snapshots)
    assert sorted((t, e.pool.value, e.old, e.new) for t, e in events) == [(10, "decode", 1, 4), (10, "prefill", 1, 3)]
    assert state.decided_at == 10


def test_decided_at_is_the_snapshot_time_of_the_last_target_change(policy):
    """The first targets count as a change (the controller relays them); a tick that changes
    no target leaves it where it was."""
    state, _ = _run(policy, [_pools(5, 1, 1)])
    assert (dict(state.targets), state.decided_at) == ({Role.PREFILL: 1, Role.DECODE: 1}, 5)
    state, events = _run(policy, [_pools(t, 1, 1) for t in range(6, 40)], state)
    assert (events, state.decided_at) == ([], 5)


def test_the_decode_load_is_counted_by_role_and_a_lent_prefill_replica_is_reclaimed_before_shrinking(policy):
    lent_p0 = _replica("p0", Role.PREFILL, role=Role.BOTH, decoding=8)
    snapshots = [Snapshot(time=t, replicas=(lent_p0, _replica("d0", Role.DECODE, decoding=6))) for t in range(11)]
    _, events = _run(policy, snapshots, lent=frozenset({"p0"}))
    assert [(e.pool, e.new) for _, e in events] == [(Role.DECODE, 3)]  # 14 decoding by role: 3 at 6 each
    # two prefill replicas, idle, one lent: the prefill pool does not shrink until it is back
    state = ScaleState().with_pool(Role.PREFILL, targets=2).with_pool(Role.DECODE, targets=1)
    idle = [
        Snapshot(time=t, replicas=(_replica("p0", Role.PREFILL, role=Role.BOTH), _replica("p1", Role.PREFILL)))
        for t in range(100)
    ]
    assert _run(policy, idle, state, lent=frozenset({"p0"}))[1] == []
    assert [e.kind for _, e in _run(policy, idle, state)[1]] == [ScaleKind.DOWN]


def test_replicas_that_never_arrive_are_given_up_with_a_doubling_back_off(policy):
    """Target 4, one replica reports (a pod left Pending): after pending_timeout_s the target
    falls back to 1 and the pool asks again only after the back-off; met scale-ups reset it."""
    timeout, loaded = policy.scaling.pending_timeout_s, range(0, 400)
    state, events = _run(policy, [_pools(t, 1, 1, decoding=40) for t in loaded])
    kinds = [(t, e.kind, e.new) for t, e in events]
    assert timeout == 60 and kinds[:5] == [
        (10, ScaleKind.UP, 4),
        (71, ScaleKind.GIVE_UP, 1),  # asked at 10, pending from 11, given up 60 s later
        (141, ScaleKind.UP, 4),  # back-off 60 s to 131, then the need lasts 10 s again
        (202, ScaleKind.GIVE_UP, 1),
        (332, ScaleKind.UP, 4),  # back-off doubled: 120 s to 322, + 10 s
    ]
    assert "3 replica(s) asked for 60s ago never reported" in events[1][1].reason
    assert state.backoff_s[Role.DECODE] > timeout
    # the replicas arrive after a scale-up: the back-off starts over
    met = [_pools(t, 1, 4, decoding=40) for t in range(400, 403)]
    state = state.with_pool(Role.DECODE, targets=4, pending_since=399.0)
    state, _ = _run(policy, met, state)
    assert Role.DECODE not in state.backoff_s


def test_no_scaling_when_the_policy_turns_it_off(policy):
    off = policy.model_copy(update={"scaling": policy.scaling.model_copy(update={"enabled": False})})
    assert _run(off, [_pools(t, 1, 1, decoding=40) for t in range(30)])[1] == []


# ---- Serve's side: the policy functions on AutoscalingContext -----------------------------


def _context(pool: str, relayed: dict[str, tuple[int, float]], current: int, policy: Policy) -> AutoscalingContext:
    """Serve's context for ``pool`` with ``relayed``: replica -> (target, decision time)."""
    deployment = DeploymentID(name="DecodeServer" if pool == "decode" else "PrefillServer", app_name="tandem")
    replicas = {name: ReplicaID(unique_id=name, deployment_id=deployment) for name in relayed}
    raw = {
        TARGET_METRIC: {
            replicas[n]: [TimeStampedValue(100.0 + i, float(t))] for i, (n, (t, _)) in enumerate(relayed.items())
        },
        SEQ_METRIC: {replicas[n]: [TimeStampedValue(100.0 + i, s)] for i, (n, (_, s)) in enumerate(relayed.items())},
    }
    config = AutoscalingConfig(**serve_autoscaling_config(policy, pool, 1))
    return AutoscalingContext(
        deployment_id=deployment,
        deployment_name=deployment.name,
        app_name="tandem",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=list(replicas.values()),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={},
        raw_metrics=raw,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=200.0,
        config=config,
    )


def test_serves_policy_follows_the_newest_relayed_decision_and_holds_without_one(policy):
    wrapped = _apply_autoscaling_config(follow_decision)  # as Serve runs a deployment-level policy
    # d1 relays an older decision (3) than d0 (2): the newest wins
    assert wrapped(_context("decode", {"d0": (2, 50.0), "d1": (3, 40.0)}, 1, policy))[0] == 2
    assert wrapped(_context("decode", {}, 3, policy))[0] == 3  # nothing relayed yet: hold
    assert wrapped(_context("prefill", {"p0": (1, 70.0)}, 2, policy))[0] == 1


def test_the_application_level_policy_moves_both_pools(policy):
    contexts = {}
    for pool, relayed in (("prefill", {"p0": (2, 80.0)}), ("decode", {"d0": (3, 80.0)})):
        ctx = _context(pool, relayed, 1, policy)
        contexts[ctx.deployment_id] = ctx
    targets, _ = _apply_app_level_autoscaling_config(follow_decisions)(contexts)
    assert sorted((d.name, n) for d, n in targets.items()) == [("DecodeServer", 3), ("PrefillServer", 2)]


def test_the_builders_autoscaling_config_is_valid_for_serve(policy):
    config = AutoscalingConfig(**serve_autoscaling_config(policy, "decode", 2))
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 4, 2)
    assert (config.upscale_delay_s, config.downscale_delay_s) == (0, 0)  # the decision's delays
    assert config.policy.policy_function == "autoscaling.serve_policy:follow_decision"


# ---- the policy file and the app's settings ------------------------------------------------


def test_contradictory_scaling_fields_are_refused_by_name(tmp_path):
    base = (load_policy.__globals__["POLICY_DIR"] / "default.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        base.replace("decode: {min_replicas: 1, max_replicas: 4", "decode: {min_replicas: 5, max_replicas: 4")
    )
    with pytest.raises(PolicyError, match=r"scaling\.decode: min_replicas \(5\) must not be above max_replicas \(4\)"):
        load_policy(str(bad))
    bad.write_text(base.replace("prefill: {min: 0, max: 64}", "prefill: {min: 2, max: 64}"))
    with pytest.raises(PolicyError, match=r"replicas\.prefill\.min \(2\).*scaling\.prefill\.min_replicas \(1\)"):
        load_policy(str(bad))


def test_an_initial_count_outside_the_policys_bounds_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"decode\.num_replicas \(6\) must be within .* scaling\.decode .*\(1\.\.4\)"):
        AppConfig.load({"decode.num_replicas": "6"}, environ={})
    fixed = AppConfig.load({"decode.num_replicas": "6", "autoscaling.replica_scaling": "false"}, environ={})
    assert fixed.decode.num_replicas == 6 and not fixed.replica_scaling


def test_replay_prints_replica_count_decisions(tmp_path, capsys, policy):
    import json

    snapshots = [_pools(t, 1, 1, decoding=40) for t in range(0, 12)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(s.to_json()) + "\n" for s in snapshots))
    assert main(["default", str(trace)]) == 0
    lines = capsys.readouterr().out.splitlines()
    scale_rows = [line for line in lines if "scale_up" in line]
    assert scale_rows and scale_rows[0].startswith(
        "| 10.0 | scale_up | decode pool: 1 -> 4 | decode: decoding requests 40"
    )
    assert [d.kind for _, d in replay(snapshots, policy)].count(ScaleKind.UP) == 1


# ---- the study's findings on GPU clusters (docs/benchmarks/elastic_at_scale.md) --------------


def _prefill_burst(t: float, prefill: int, queued: int, tokens_per_s: float) -> Snapshot:
    """``prefill`` prefill replicas with ``queued`` prompt tokens waiting, prompts arriving at
    ``tokens_per_s``, 0.1 ms of prefill compute per token (10,000 tokens/s per replica)."""
    observed = Observed(prompt_tokens_per_s=tokens_per_s, seconds_per_prompt_token=1e-4)
    return replace(_pools(t, prefill, 1, decoding=1, queued=queued), observed=observed)


def test_gpu_prefill_is_sized_from_the_prompt_work_arriving_not_from_a_bursts_queue():
    """A burst queued 416k prompt tokens on 11 replicas: sized from the queue (8,192 per replica)
    the first policy asked for 51 replicas; 70k tokens/s arriving at 0.1 ms each is 7 replicas
    busy, so at busy_share 0.65 the pool needs 11 and nothing changes."""
    gpu = load_policy("gpu")
    assert gpu.scaling.prefill.queued_prompt_tokens is None and gpu.scaling.prefill.busy_share == 0.65
    state = ScaleState().with_pool(Role.PREFILL, targets=11).with_pool(Role.DECODE, targets=1)
    assert _run(gpu, [_prefill_burst(t, 11, 416_336, 70_000) for t in range(0, 60)], state)[1] == []
    state, events = _run(gpu, [_prefill_burst(t, 11, 0, 140_000) for t in range(0, 60)], state)  # 14 busy
    assert [(t, e.pool, e.old, e.new) for t, e in events] == [(15, Role.PREFILL, 11, 22)]  # ceil(14 / 0.65)
    assert "prompt work (busy replicas' worth) 14 (target 0.65 per replica)" in events[0][1].reason


def test_gpu_pools_shrink_to_the_need_in_one_decision():
    """The first policy shrank a 46-replica prefill pool one replica per minute; now the surplus
    goes at once, to the fewest replicas that stay under scale_down_below (0.75) of the target."""
    gpu = load_policy("gpu")
    state = ScaleState().with_pool(Role.PREFILL, targets=46).with_pool(Role.DECODE, targets=1)
    state, events = _run(gpu, [_prefill_burst(t, 46, 0, 52_500) for t in range(0, 120)], state)  # 5.25 busy
    assert [(t, e.kind, e.old, e.new) for t, e in events] == [(60, ScaleKind.DOWN, 46, 11)]  # 5.25 / 0.4875


def test_without_an_arrival_rate_the_prompt_work_signal_holds_the_count():
    """Until the ingress has synced and a prefill has run, there is no prompt work to size from."""
    gpu = load_policy("gpu")
    state = ScaleState().with_pool(Role.PREFILL, targets=11).with_pool(Role.DECODE, targets=1)
    assert _run(gpu, [_pools(t, 11, 1, decoding=1, queued=10**6) for t in range(0, 120)], state)[1] == []


def test_prompt_arrivals_are_a_rate_over_the_window_or_over_the_time_counted():
    arrivals = PromptArrivals(window_s=30.0, started=100.0)
    assert arrivals.rate(100.5) is None  # under a second counted: no rate yet
    arrivals.add(101.0, 3000)
    arrivals.add(110.0, 0)
    assert arrivals.rate(110.0) == pytest.approx(300.0)  # 3,000 tokens over the 10 s counted
    arrivals.add(125.0, 6000)
    assert arrivals.rate(130.0) == pytest.approx(300.0)  # 9,000 over the 30 s window
    assert arrivals.rate(131.0) == pytest.approx(200.0)  # the first 3,000 left the window


def test_a_shrink_goes_no_lower_than_the_busiest_moment_of_its_delay_needed():
    """The second study run shrank a decode pool 12 -> 5 on a momentary trough, then waited
    minutes for replicas with 5,000 requests waiting; now the shrink keeps what the busiest
    decision of the surplus's 60 s needed."""
    gpu = load_policy("gpu")  # 256 per replica, KV 0.8, shrink under 0.75 of that: 192 per replica
    state = ScaleState().with_pool(Role.PREFILL, targets=1).with_pool(Role.DECODE, targets=12)
    loads = [1_000 if t % 10 == 0 else 200 for t in range(0, 70)]  # 200 most of the time, 1,000 each 10 s
    snapshots = [_pools(t, 1, 12, decoding=12 * n) for t, n in enumerate(loads)]  # n on d0
    state, events = _run(gpu, snapshots, state)
    assert [(t, e.kind, e.old, e.new) for t, e in events] == [(60, ScaleKind.DOWN, 12, 6)]  # ceil(1,000 / 192)
