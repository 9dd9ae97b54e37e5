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
        assert await controller.report("p0", "PrefillServer", "prefill", _stats(Role.PREFILL)) == "prefill"
        assert await controller.report("d0", "DecodeServer", "decode", _stats(Role.DECODE, decoding=8)) == "decode"
        (lend,) = controller.tick(time.monotonic())
        assert (lend.kind.value, lend.replica) == ("lend", "p0")
        assert "decode running_per_replica 8.00 >= enter 5.00" in lend.reason
        # assigned at once; routed to only once the replica reports the role it applied
        assert await controller.report("p0", "PrefillServer", "prefill", _stats(Role.PREFILL)) == "both"
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
