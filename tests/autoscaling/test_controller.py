"""The controller's bookkeeping, called directly (the class Serve deploys, without Serve):
replicas report and get their assigned role, the ingress's plan follows the reports at
once, every action is kept with its reason, and a lent replica that goes silent is counted
as returned with a decision that says so. The periodic calls around it (the ingress's sync,
the replicas' reports) run in contexts of their own and leave no access-log line each."""

from __future__ import annotations

import asyncio
import time

from ray.serve.context import _RequestContext, _serve_request_context

import deployments.controller
from app.settings import AppConfig
from autoscaling.messages import IngressReport, LatencySample, PoolTarget, ReplicaReport, ReportAnswer, RoutingPlan
from deployments.build import build_disagg
from deployments.controller import AutoscalerController
from deployments.elastic_routing import ElasticRouting
from engine.params import EngineStats, Role
from tests.waiting import wait_until_async

DEPLOYMENTS = {Role.PREFILL: "PrefillServer", Role.DECODE: "DecodeServer"}


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


def _report(replica: str, home: Role, stats: EngineStats, stopping: bool = False) -> ReplicaReport:
    return ReplicaReport(replica, DEPLOYMENTS[home], home, stats, stopping=stopping)


def test_report_tick_sync_and_view():
    controller = AutoscalerController(AppConfig.load({}, environ={}))

    async def scenario() -> None:
        first = await controller.report(_report("p0", Role.PREFILL, _stats(Role.PREFILL)))
        assert first == ReportAnswer(role=Role.PREFILL, target=None)  # no replica-count decision yet
        decode = await controller.report(_report("d0", Role.DECODE, _stats(Role.DECODE, decoding=8)))
        assert decode.role is Role.DECODE
        (lend,) = controller.tick(time.monotonic())
        assert (lend.kind.value, lend.replica) == ("lend", "p0")
        assert "decode running_per_replica 8.00 >= enter 5.00" in lend.reason
        # assigned at once; routed to only once the replica reports the role it applied
        answer = await controller.report(_report("p0", Role.PREFILL, _stats(Role.PREFILL)))
        assert answer.role is Role.BOTH
        assert answer.target is not None and answer.target.num_replicas == 1  # the pools start from what reports
        assert (await controller.sync(IngressReport())).lent == 0
        await controller.report(_report("p0", Role.PREFILL, _stats(Role.BOTH)))
        plan = await controller.sync(IngressReport((LatencySample(ttft_s=1.0, tpot_s=0.05, prefill_s=0.5),)))
        assert plan == RoutingPlan(prefill=1, decode=1, lent=1, decode_kv_usage=0.4, tpot_p90_s=None)
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


def test_wall_clock_reads_an_instant_of_the_monotonic_clock_on_the_wall_clock():
    """The wall clock read just before and just after brackets it (only a wall-clock step between could break it)."""
    before, now, after = time.time(), deployments.controller.wall_clock(time.monotonic()), time.time()
    assert before - 1e-3 <= now <= after + 1e-3


def test_replica_counts_are_relayed_in_report_answers_and_a_stopping_replica_leaves_at_once(monkeypatch):
    """Both pools' targets come from the tick's one decision and go back in each replica's
    report answer (the replica relays its own pool's to Serve), with the decision's time. The
    view counts a tensor-parallel pool's GPUs: replicas x ranks x GPUs per rank."""
    monkeypatch.setattr(deployments.controller, "wall_clock", lambda monotonic_s: 1e9 + monotonic_s)  # exact
    tp_decode = {"decode.tensor_parallel_size": "2", "decode.num_gpus": "1"}
    controller = AutoscalerController(AppConfig.load(tp_decode, environ={}))
    delay = controller.policy.scaling.scale_up_delay_s

    async def report(replica: str, home: Role, decoding: int = 0, stopping: bool = False) -> ReportAnswer:
        return await controller.report(_report(replica, home, _stats(home, decoding), stopping=stopping))

    async def scenario() -> None:
        await report("p0", Role.PREFILL)
        await report("d0", Role.DECODE, decoding=14)  # 14 decoding, target 6 per replica: needs 3
        start = time.monotonic()
        controller.tick(start)
        first = (await report("d0", Role.DECODE, decoding=14)).target
        assert first is not None and first.num_replicas == 1
        assert first.seq == 1e9 + start  # the decision's wall-clock time
        later = start + delay + 0.5
        controller._reports = {k: (later, load) for k, (_, load) in controller._reports.items()}  # reported since
        controller.tick(later)
        answer = await report("d0", Role.DECODE, decoding=14)
        assert answer.target == PoolTarget(num_replicas=3, seq=answer.target.seq)
        assert answer.target.seq == 1e9 + later  # the instant of the second decision
        assert controller.scale_state.decided_at == later
        assert (await report("p0", Role.PREFILL)).target == PoolTarget(1, answer.target.seq)  # from the same decision
        view = (await controller.view())["scaling"]
        assert view["pools"]["decode"] == {
            "target": 3, "reporting": 1, "pending": 2, "backoff_s": 0, "gpus_per_replica": 2, "target_gpus": 6
        }  # fmt: skip
        (event,) = [d for d in (await controller.view())["decisions"] if d["action"] == "scale_up"]
        assert (event["pool"], event["replicas"]) == ("decode", [1, 3])
        assert "decoding requests 14 (target 6 per replica)" in event["reason"]
        assert "on 1 replica(s): needs 3 (max 4), for 10s: 1 -> 3" in event["reason"]
        # a stopping replica is left out at once, not after stale_after_s
        assert await report("d0", Role.DECODE, stopping=True) == ReportAnswer(role=Role.DECODE)
        assert "d0" not in controller._reports

    asyncio.run(scenario())


def test_replica_scaling_off_relays_nothing():
    controller = AutoscalerController(AppConfig.load({"autoscaling.replica_scaling": "false"}, environ={}))

    async def scenario() -> None:
        await controller.report(_report("d0", Role.DECODE, _stats(Role.DECODE, decoding=14)))
        controller.tick(time.monotonic())
        answer = await controller.report(_report("d0", Role.DECODE, _stats(Role.DECODE, decoding=14)))
        assert answer == ReportAnswer(role=Role.DECODE, target=None)
        assert (await controller.view())["scaling"]["enabled"] is False

    asyncio.run(scenario())


class _Call:
    """A handle method's stand-in: records the Serve request context each call runs in."""

    def __init__(self, answer: object) -> None:
        self.answer, self.contexts = answer, []

    def remote(self, *args: object) -> asyncio.Future:
        self.contexts.append(_serve_request_context.get())
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.answer)
        return future


def test_background_loops_carry_no_client_request_id():
    """The ingress's sync loop and the controller's decision loop start during some call; they
    must not carry that call's request id (in their log lines, in the calls they make)."""
    config = AppConfig.load({}, environ={})
    plan = RoutingPlan(prefill=1, decode=1, lent=0, decode_kv_usage=None, tpot_p90_s=None)
    sync = _Call(plan)
    routing = ElasticRouting(type("Controller", (), {"sync": sync})(), config.autoscaling.load())
    controller = AutoscalerController(config)
    ticks: list[object] = []
    controller.tick = lambda now: ticks.append(_serve_request_context.get()) or []

    async def scenario() -> None:
        _serve_request_context.set(_RequestContext(request_id="client-request-id"))
        routing._start()  # as the first request does
        await controller.report(_report("d0", Role.DECODE, _stats(Role.DECODE)))
        await wait_until_async(lambda: bool(sync.contexts and ticks), 30, "a sync and a tick")
        assert _serve_request_context.get().request_id == "client-request-id"  # the call's own context is kept
        for task in (routing._task, controller._task):
            task.cancel()

    asyncio.run(scenario())
    assert sync.contexts[0] is None and ticks[0] is None
    assert routing.plan == plan


def test_the_controller_deployment_writes_no_access_log_line_per_call():
    """Serve's access log would write a line for every sync and every report (several a
    second); decisions are logged by the controller itself."""
    app = build_disagg(AppConfig.load({}, environ={}))
    controller = app._bound_deployment.init_kwargs["controller"]._bound_deployment
    logging_config = controller._deployment_config.logging_config
    assert logging_config["enable_access_log"] is False
    assert logging_config["log_level"] == "INFO"
