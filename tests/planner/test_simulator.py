"""The simulator on hand-computable cases, and against this machine's measured goodput ordering."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autoscaling.policy import Scaling, load_policy
from planner.costs import DEFAULT_CALIBRATION, ServingStack, calibrated_cost, load_calibration
from planner.sim_engine import mixed_step_s
from planner.simulator import SimRequest, SystemSpec, goodput, sim_requests, simulate, uncontended_latency

FROZEN = Path(__file__).parent / "goodput_frozen.json"
KV_BYTES = 1000


def _cost(capacity: int = 100_000):
    """Known costs: prefill 10 ms + 3 ms a token; decode step 40 ms + 2 ms a sequence + 1 us a
    KV token; transfer 1 ms + 1 GB/s; 1,000 KV bytes a token."""
    return calibrated_cost(
        {
            "engine": {"kv_bytes_per_token": KV_BYTES, "kv_capacity_tokens": capacity},
            "prefill": [{"tokens": n, "seconds": 0.01 + 0.003 * n} for n in (16, 512)],
            "decode": [
                {"batch": b, "context_tokens": c, "seconds": 0.04 + 0.002 * b + 1e-6 * c}
                for b in (1, 2, 8)
                for c in (100, 1000)
            ],
            "transfer": [{"bytes": n, "seconds": 0.001 + n / 1e9} for n in (1000, 10**6)],
        }
    )


COST = _cost()


def prefill(n: int) -> float:
    return 0.01 + 0.003 * n


def step(batch: int, context: int) -> float:
    return 0.04 + 0.002 * batch + 1e-6 * context


def transfer(prompt: int) -> float:
    return 0.001 + prompt * KV_BYTES / 1e9


def disagg(prefill_replicas: int = 1, decode_replicas: int = 1, **kw) -> SystemSpec:
    return SystemSpec("disaggregated", prefill_replicas, decode_replicas, COST, COST, **kw)


def colocated(replicas: int = 1, **kw) -> SystemSpec:
    return SystemSpec("colocated", replicas, 0, COST, COST, **kw)


def test_one_request_alone_disaggregated() -> None:
    """TTFT = prefill + KV pull (the first token leaves the decode replica when it admits the
    request); TPOT = the decode steps' mean, the KV growing one token a step from prompt + 1."""
    (record,) = simulate(disagg(), [SimRequest(0.0, 100, 5)]).records
    assert record.ttft_s == pytest.approx(prefill(100) + transfer(100))
    assert record.tpot_s == pytest.approx(sum(step(1, 101 + k) for k in range(4)) / 4)
    assert record.e2e_s == pytest.approx(record.ttft_s + 4 * record.tpot_s)


def test_one_request_alone_colocated_and_one_token() -> None:
    (record,) = simulate(colocated(), [SimRequest(0.0, 100, 5)]).records
    assert record.ttft_s == pytest.approx(prefill(100))
    assert record.tpot_s == pytest.approx(sum(step(1, 101 + k) for k in range(4)) / 4)
    (single,) = simulate(disagg(), [SimRequest(0.0, 100, 1)]).records
    assert single.ttft_s == pytest.approx(prefill(100)) and single.tpot_s is None  # no transfer: done at prefill
    assert single.e2e_s == single.ttft_s


def test_two_prompts_at_once_share_one_prefill_batch() -> None:
    records = simulate(disagg(decode_replicas=2), [SimRequest(0.0, 100, 3), SimRequest(0.0, 60, 3)]).records
    assert [r.ttft_s for r in records] == pytest.approx([prefill(160) + transfer(100), prefill(160) + transfer(60)])


def test_two_prompts_over_the_token_budget_queue_fifo() -> None:
    records = simulate(disagg(max_num_batched_tokens=150), [SimRequest(0.0, 100, 5), SimRequest(0.0, 100, 5)]).records
    assert records[0].ttft_s == pytest.approx(prefill(100) + transfer(100))
    # the first request's four decode steps end before the second's KV arrives: no wait at decode
    assert records[1].ttft_s == pytest.approx(2 * prefill(100) + transfer(100))


def test_colocated_prompt_waits_for_the_step_boundary_then_shares_the_step() -> None:
    """B arrives while A decodes: it is admitted at A's next step boundary, into one step
    with A's decode (the engine scheduler: decodes first, then prompts in the budget)."""
    records = simulate(colocated(), [SimRequest(0.0, 100, 10), SimRequest(0.4, 200, 2)]).records
    boundary, context = prefill(100), 101
    while boundary < 0.4:
        boundary += step(1, context)
        context += 1
    mixed = mixed_step_s(COST, 1, context, 200)
    assert mixed == pytest.approx(prefill(201) + 1e-6 * context)
    assert records[1].ttft_s == pytest.approx(boundary + mixed - 0.4)


def test_prefill_first_scheduler_runs_a_prompt_alone_while_the_decodes_wait() -> None:
    """vLLM 0.2's scheduler (DistServe's baseline): B arrives during A's first decode step; at
    that step's end B's prompt runs in a step of its own (A's decode waits), where this
    engine's scheduler would run A's decode in the same step."""
    requests = [SimRequest(0.0, 100, 4), SimRequest(0.32, 100, 2)]
    boundary = prefill(100) + step(1, 101)  # A's first token, then its first decode step
    a, b = simulate(colocated(prefill_first=True), requests).records
    assert b.ttft_s == pytest.approx(boundary + prefill(100) - 0.32)
    mixed_a, mixed_b = simulate(colocated(), requests).records
    assert mixed_b.ttft_s == pytest.approx(boundary + mixed_step_s(COST, 1, 102, 100) - 0.32)
    assert a.e2e_s > mixed_a.e2e_s  # A's decode stalled for B's whole prompt


def test_chunked_prefill_cuts_prompts_to_the_budget() -> None:
    (record,) = simulate(colocated(chunked_prefill=True, max_num_batched_tokens=64), [SimRequest(0.0, 100, 2)]).records
    assert record.ttft_s == pytest.approx(prefill(64) + prefill(36))


def test_decode_kv_pool_full_makes_the_next_request_wait() -> None:
    small = _cost(capacity=4500)
    system = SystemSpec("disaggregated", 1, 1, small, small, max_num_batched_tokens=8192)
    first, second = simulate(system, [SimRequest(0.0, 4000, 3), SimRequest(0.0, 1000, 3)]).records
    assert second.ttft_s >= first.e2e_s  # 4,003 + 1,003 KV tokens > 4,500: its pull waits for the first to end


def test_interference_slows_a_step_that_starts_while_another_replica_computes() -> None:
    records = simulate(colocated(2, interference=0.5), [SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)]).records
    assert [r.ttft_s for r in records] == pytest.approx([prefill(100), 1.5 * prefill(100)])


def test_serving_stack_adds_its_hops_to_ttft_and_slows_each_phase_by_its_factor() -> None:
    """``ServingStack``: ``ttft_s`` once per request; steps with prompt tokens x
    ``prefill_factor``, decode steps x ``decode_factor`` (the served replica's slowdown)."""
    stack = ServingStack(ttft_s=0.25, prefill_factor=1.5, decode_factor=1.2)
    (alone,) = simulate(colocated(stack=stack), [SimRequest(0.0, 100, 5)]).records
    assert alone.ttft_s == pytest.approx(1.5 * prefill(100) + 0.25)
    assert alone.tpot_s == pytest.approx(1.2 * sum(step(1, 101 + k) for k in range(4)) / 4)
    assert alone.e2e_s == pytest.approx(alone.ttft_s + 4 * alone.tpot_s)
    pair = simulate(disagg(stack=stack), [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3)]).records
    both = 1.2 * (step(2, 202) + step(2, 204)) / 2  # two steps of two sequences, 101 then 102 KV each
    assert [r.tpot_s for r in pair] == pytest.approx([both, both])
    first = 1.5 * prefill(200) + transfer(100) + 0.25  # one prefill step of both prompts, then a pull each
    assert [r.ttft_s for r in pair] == pytest.approx([first, first])


def test_batched_decode_factors_slow_steps_by_their_batch() -> None:
    """``batched_decode_factors`` on steps of 2+ sequences (linear between the probed batches,
    the last beyond), ``decode_factor`` on batch-1 steps: two requests decode together, then
    the longer one alone."""
    stack = ServingStack(decode_factor=1.2, batched_decode_factors=((2, 1.5), (4, 2.0)))
    assert [stack.decode_factor_at(b) for b in (1, 2, 3, 4, 9)] == [1.2, 1.5, 1.75, 2.0, 2.0]
    short, long = simulate(colocated(1, stack=stack), [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 5)]).records
    together = [1.5 * step(2, 202 + 2 * k) for k in range(2)]  # 101 + k KV each
    assert short.tpot_s == pytest.approx(sum(together) / 2)
    alone = [1.2 * step(1, 103 + k) for k in range(2)]
    assert long.tpot_s == pytest.approx((sum(together) + sum(alone)) / 4)


def test_serving_stack_cpu_over_subscribes_the_cores_and_slows_every_step() -> None:
    """Processor sharing: on one core, a replica streaming 1 / step(1, 101) tokens/s beside a
    stack that spends 10 ms of CPU per token runs its steps ``1 + 0.01 / step`` slower; the
    prompt's step streams nothing and is not slowed. Two cores leave room: no slowdown."""
    one_core = ServingStack(cpu_s_per_token=0.01, cores=1)  # factors 1: the bare engine
    (record,) = simulate(colocated(stack=one_core), [SimRequest(0.0, 100, 5)]).records
    factor = 1 + 0.01 / step(1, 101)
    assert record.ttft_s == pytest.approx(prefill(100))
    assert record.tpot_s == pytest.approx(sum(step(1, 101 + k) for k in range(4)) * factor / 4)
    (roomy,) = simulate(colocated(stack=replace(one_core, cores=2)), [SimRequest(0.0, 100, 5)]).records
    assert roomy.tpot_s == pytest.approx(sum(step(1, 101 + k) for k in range(4)) / 4)


def test_calibrated_stack_is_read_per_system_kind() -> None:
    data = {**json.loads(DEFAULT_CALIBRATION.read_text())}
    colocated_stack = {"ttft_s": 0.1, "prefill_factor": 1.3, "decode_factor": 1.2, "cpu_s_per_token": 0.003, "cores": 2}
    data["stack"] = {"kinds": {"colocated": colocated_stack}}
    cost = calibrated_cost(data)
    assert cost.stack("colocated") == ServingStack(0.1, 1.3, 1.2, 0.003, 2)
    assert cost.stack("disaggregated") == ServingStack()  # not measured: none


def test_simulation_is_deterministic() -> None:
    requests = sim_requests("chatbot", 4.0, 300, 512, seed=1)
    system = disagg(3, 5)
    assert simulate(system, requests) == simulate(system, requests)


def test_elastic_policy_lends_under_a_decode_burst_and_reclaims_after() -> None:
    lending_only = load_policy("default").model_copy(update={"scaling": Scaling(enabled=False)})
    burst = [SimRequest(0.1 * i, 32, 200) for i in range(120)]
    result = simulate(disagg(policy=lending_only), burst)
    kinds = [d.kind for d in result.decisions]
    assert kinds[0] == "lend" and "reclaim" in kinds
    assert all(d.replica == 0 and d.pool == "prefill" and d.reason for d in result.decisions)  # the prefill replica
    assert len(result.records) == 120
    reclaimed = next(d.time_s for d in result.decisions if d.kind == "reclaim")
    assert max(s.lent for s in result.timeline) == 1
    assert next(s for s in result.timeline if s.time_s >= reclaimed).lent == 0


def test_elastic_policy_scales_the_decode_pool_up_after_its_delay() -> None:
    """The default policy: 6 decoding requests per decode replica at most, 10 s of need
    before a scale-up; the new replicas serve ``startup_s`` later, and the burst's TPOT falls
    below what lending alone gives. The replicas held grow by the new ones from the decision on."""
    policy = load_policy("default")
    burst = [SimRequest(0.25 * i, 32, 200) for i in range(600)]
    result = simulate(disagg(policy=policy), burst)
    ups = [d for d in result.decisions if d.kind == "scale_up" and d.pool == "decode"]
    assert ups and ups[0].time_s >= policy.scaling.scale_up_delay_s and ups[0].new > ups[0].old
    assert max(d.new for d in ups) <= policy.scaling.decode.max_replicas
    assert len(result.records) == 600
    first = next(s for s in result.timeline if s.time_s >= ups[0].time_s)
    assert first.starting == ups[0].new - ups[0].old and first.held_decode == 1 + first.starting
    serving = next(s for s in result.timeline if s.time_s >= ups[0].time_s + SystemSpec.world.startup_s)
    assert serving.decode == ups[0].new and serving.starting == 0
    assert result.replica_seconds["decode"] > 1.5 * result.records[-1].arrival_s > 0
    lending_only = simulate(disagg(policy=policy.model_copy(update={"scaling": Scaling(enabled=False)})), burst)
    assert result.percentiles()["tpot_s"]["p90"] < lending_only.percentiles()["tpot_s"]["p90"]


def test_goodput_finds_a_passing_rate() -> None:
    def make(rate: float):
        return sim_requests("code", rate, 200, 512)

    rate = goodput(disagg(), make, ttft_slo_s=1.0, tpot_slo_s=0.08)
    assert rate > 0
    assert simulate(disagg(), make(rate)).attainment(1.0, 0.08) >= 0.9
    assert goodput(disagg(), make, ttft_slo_s=1.0, tpot_slo_s=0.08, max_rate=rate / 2) == rate / 2


@pytest.mark.parametrize("workload", ["summarization", "code", "chatbot"])
def test_colocated_vs_disaggregated_ordering_matches_this_machine(workload: str) -> None:
    """bench.compare's systems on the recorded calibration (2 replicas of 1 core each, with
    the serving stack measured for each kind): the simulated goodput of colocated and
    disagg-pull order as measured (tests/planner/goodput_frozen.json), each on SLOs made as
    bench.compare makes them: the same multiples of the idle colocated system's uncontended
    TTFT and TPOT (measured there, simulated here), so a calibration of a slower or faster day
    of this machine compares with the frozen results."""
    frozen = json.loads(FROZEN.read_text())
    row = frozen["workloads"][workload]
    cost = load_calibration()
    measured = {name: row["goodput"][name]["rate"] for name in ("colocated", "disagg-pull")}
    base = SystemSpec("colocated", 2, 0, cost, cost, interference=cost.interference, stack=cost.stack("colocated"))
    systems = {
        "colocated": base,
        "disagg-pull": replace(
            base, kind="disaggregated", prefill_replicas=1, decode_replicas=1, stack=cost.stack("disaggregated")
        ),
    }
    idle = row["uncontended"]
    ttft, tpot = uncontended_latency(base, idle["prompt_tokens"])
    slo = {"ttft": ttft * row["slo_s"]["ttft"] / idle["ttft_s"], "tpot": tpot * row["slo_s"]["tpot"] / idle["tpot_s"]}
    assert slo["ttft"] / ttft == pytest.approx(5.0) and slo["tpot"] / tpot == pytest.approx(2.0)

    def make(rate: float):
        return [r for seed in range(5) for r in _shifted(sim_requests(workload, rate, 80, 512, seed=seed), seed)]

    simulated = {name: goodput(s, make, slo["ttft"], slo["tpot"], rel_tol=0.02) for name, s in systems.items()}
    assert (simulated["disagg-pull"] > simulated["colocated"]) == (measured["disagg-pull"] > measured["colocated"])


def _shifted(requests: list[SimRequest], seed: int) -> list[SimRequest]:
    """Five independent runs back to back (1,000 s apart) in one simulation."""
    return [replace(r, arrival_s=r.arrival_s + 1000.0 * seed) for r in requests]
