"""The controller's bookkeeping, called directly (the class Serve deploys, without Serve):
replicas report and get their assigned role, the ingress's plan follows the reports at
once, every action is kept with its reason, and a lent replica that goes silent is counted
as returned with a decision that says so."""

from __future__ import annotations

import asyncio
import time

from app.settings import AppConfig
from autoscaling.controller import AutoscalerController
from engine.params import EngineStats, Role


def _stats(role: Role, decoding: int = 0, queued: int = 0) -> EngineStats:
    return EngineStats(
        role=role,
        num_total_blocks=100,
        num_free_blocks=100 - 5 * decoding,
        num_pinned_blocks=0,
        num_reserved_blocks=0,
        num_running=decoding,
        num_waiting=0,
        block_size=16,
        num_preemptions=0,
        median_step_ms=50.0,
        num_decoding=decoding,
        num_queued_prompt_tokens=queued,
    )


def test_report_tick_sync_and_view():
    controller = AutoscalerController(AppConfig.load({}, environ={}).model_dump())

    async def scenario() -> None:
        first = await controller.report("p0", "PrefillServer", "prefill", _stats(Role.PREFILL))
        assert first == {"role": "prefill", "target": None, "seq": None}  # no replica-count decision yet
        assert (await controller.report("d0", "DecodeServer", "decode", _stats(Role.DECODE, decoding=8)))[
            "role"
        ] == "decode"
        (lend,) = controller.tick(time.monotonic())
        assert (lend.kind.value, lend.replica) == ("lend", "p0")
        assert "decode running_per_replica 8.00 >= enter 5.00" in lend.reason
        # assigned at once; routed to only once the replica reports the role it applied
        answer = await controller.report("p0", "PrefillServer", "prefill", _stats(Role.PREFILL))
        assert (answer["role"], answer["target"]) == ("both", 1)  # the pools start from the replicas that report
        assert (await controller.sync([]))["lent"] == 0
        await controller.report("p0", "PrefillServer", "prefill", _stats(Role.BOTH))
        plan = await controller.sync([(1.0, 0.05, 0.5)])
        assert (plan["prefill"], plan["decode"], plan["lent"]) == (1, 1, 1)
        view = await controller.view()
        assert view["policy"] == "default"
        assert [(d["action"], d["replica"], d["role"]) for d in view["decisions"]] == [("lend", "p0", "both")]
        assert {r["replica_id"]: r["assigned_role"] for r in view["replicas"]} == {"d0": "decode", "p0": "both"}

    asyncio.run(scenario())
    # p0 goes silent: counted as returned, with a decision naming why
    seen, load = controller._reports["p0"]
    controller._reports["p0"] = (seen - 100, load)
    controller.tick(seen + 1)
    last = asyncio.run(controller.view())["decisions"][-1]
    assert (last["action"], last["replica"], last["reason"]) == ("reclaim", "p0", "no report for over 10s")
    assert controller.state.lent == frozenset()


def test_replica_counts_are_relayed_in_report_answers_and_a_stopping_replica_leaves_at_once():
    """Both pools' targets come from the tick's one decision and go back in each replica's
    report answer (the replica relays its own pool's to Serve), with the decision's time."""
    controller = AutoscalerController(AppConfig.load({}, environ={}).model_dump())
    delay = controller.policy.scaling.scale_up_delay_s

    async def report(replica: str, home: Role, decoding: int = 0, stopping: bool = False) -> dict:
        deployment = "PrefillServer" if home is Role.PREFILL else "DecodeServer"
        return await controller.report(replica, deployment, home.value, _stats(home, decoding), stopping=stopping)

    async def scenario() -> None:
        await report("p0", Role.PREFILL)
        await report("d0", Role.DECODE, decoding=14)  # 14 decoding, target 6 per replica: needs 3
        start = time.monotonic()
        controller.tick(start)
        first = await report("d0", Role.DECODE, decoding=14)
        assert first["target"] == 1 and first["seq"] is not None
        later = start + delay + 0.5
        controller._reports = {k: (later, load) for k, (_, load) in controller._reports.items()}  # reported since
        controller.tick(later)
        answer = await report("d0", Role.DECODE, decoding=14)
        assert answer["target"] == 3 and answer["seq"] > first["seq"]
        assert (await report("p0", Role.PREFILL))["target"] == 1
        view = (await controller.view())["scaling"]
        assert view["pools"]["decode"] == {"target": 3, "reporting": 1, "pending": 2, "backoff_s": 0}
        (event,) = [d for d in (await controller.view())["decisions"] if d["action"] == "scale_up"]
        assert (event["pool"], event["replicas"]) == ("decode", [1, 3])
        assert "decoding requests 14 (target 6 per replica)" in event["reason"]
        assert "on 1 replica(s): needs 3 (max 4), for 10s: 1 -> 3" in event["reason"]
        # a stopping replica is left out at once, not after stale_after_s
        assert (await report("d0", Role.DECODE, stopping=True))["target"] is None
        assert "d0" not in controller._reports

    asyncio.run(scenario())


def test_replica_scaling_off_relays_nothing():
    controller = AutoscalerController(AppConfig.load({"autoscaling.replica_scaling": "false"}, environ={}).model_dump())

    async def scenario() -> None:
        await controller.report("d0", "DecodeServer", "decode", _stats(Role.DECODE, decoding=14))
        controller.tick(time.monotonic())
        answer = await controller.report("d0", "DecodeServer", "decode", _stats(Role.DECODE, decoding=14))
        assert answer["target"] is None
        assert (await controller.view())["scaling"]["enabled"] is False

    asyncio.run(scenario())
