"""Asynchronous scheduling (``engine.overlap``) on CPU: a decode step left in flight while the
next one is launched gives the synchronous engine's tokens, logprobs, usage and finish
reasons, through the eager path (``async_scheduling="on"``) and the graph path (``"auto"``
with ``FakeCudaGraph`` standing in for the GPU's graph). Requests that end or are aborted
while a step holding them is in flight keep their blocks until that step lands."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.params import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from tests.engine.conftest import run_to_completion, tiny_loaded
from tests.engine.test_cuda_graphs import SIZES, FakeCudaGraph
from tests.same_output import assert_same_alternatives
from tests.tiny_models import SHARP

PROMPTS = [[(7 * i + 5 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 14, 28, 9))]


def _engine(make_engine, mode: str, **config: object) -> EngineCore:
    """``mode``: "sync" (off), "eager" (on, no graphs) or "graphs" (auto, fake graphs)."""
    loaded, _ = tiny_loaded("llama", initializer_range=SHARP)
    setting = {"sync": "off", "eager": "on", "graphs": "auto"}[mode]
    config.setdefault("max_model_len", 256)
    core = make_engine(loaded, block_size=8, async_scheduling=setting, **config)
    if mode == "graphs":
        core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph)
    return core


def _requests(params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", tuple(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def _seen(outputs: dict[str, list[RequestOutput]]) -> dict[str, tuple]:
    """What a client sees of each request but its logprobs: every output's tokens, usage and finish."""
    return {
        rid: [(o.token_ids, o.num_output_tokens, o.finished, o.finish_reason) for o in outs]
        for rid, outs in outputs.items()
    }


def _assert_same(got: dict[str, list[RequestOutput]], expected: dict[str, list[RequestOutput]]) -> None:
    """Equal but for the logprobs' last bits (a step in flight pads its batch differently)."""
    assert _seen(got) == _seen(expected)
    for rid, outs in expected.items():
        pairs = zip((lp for o in got[rid] for lp in o.logprobs), (lp for o in outs for lp in o.logprobs), strict=True)
        for step, (lp, want) in enumerate(pairs):
            assert lp.token_id == want.token_id and lp.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert_same_alternatives(lp.top, want.top, label=f"{rid} token {step}")


def _greedy(max_tokens: int, **fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3, **fields)


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_steps_in_flight_give_the_synchronous_tokens_and_free_every_block(make_engine, mode):
    """Four requests ending one after another (max_tokens 5 to 23), two of them arriving while
    others decode (the step in flight lands first, then the prompts run synchronously), one
    sampled with a seed and one stopped by a stop token mid-way: everything a client sees is
    the synchronous engine's."""
    sync = _engine(make_engine, "sync")
    alone = [o.token_ids[0] for o in run_to_completion(sync, {0: _requests([_greedy(12)])})["r0"]]
    stop = alone[6]  # r1 has r0's prompt: it stops at this token's first occurrence
    params = [_greedy(12), _greedy(23, stop_token_ids=(stop,)), _greedy(5), _greedy(17)]
    params[3] = SamplingParams(max_tokens=17, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=2)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    requests = _requests(params, prompts)
    arrivals = {0: requests[:2], 4: requests[2:3], 9: requests[3:]}
    expected = run_to_completion(sync, arrivals)
    core = _engine(make_engine, mode)
    steps = []
    core.step = _counted(core.step, steps)
    _assert_same(run_to_completion(core, arrivals), expected)
    assert expected["r1"][-1].finish_reason is FinishReason.STOP and len(expected["r1"]) == alone.index(stop) + 1
    assert [len(expected[r]) for r in ("r0", "r2", "r3")] == [12, 5, 17]
    # a step was left in flight three times (that step returned nothing): after the first
    # prompts and after each arrival's prompt; every later decode step launched the next first
    assert steps.count(0) == 3


def _counted(step, counts: list[int]):
    """``step`` that records how many outputs each call returned."""

    def counted() -> list[RequestOutput]:
        outputs = step()
        counts.append(len(outputs))
        return outputs

    return counted


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_a_step_is_left_in_flight_only_for_plain_decoding(make_engine, mode):
    """Decode steps of plain requests are left in flight (``step()`` returns nothing, the
    next one returns their tokens); a request with penalties keeps the batch synchronous."""
    core = _engine(make_engine, mode)
    core.add_request(_requests([_greedy(6)])[0])
    assert [len(o.token_ids) for o in core.step()] == [1]  # the prompt: synchronous
    assert core.step() == []  # the first decode step, left in flight
    assert [o.num_output_tokens for o in core.step()] == [2]  # it lands as the next is launched
    penalized = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, frequency_penalty=0.5)
    core.add_request(GenerationRequest("p", tuple(PROMPTS[1]), penalized))
    assert [o.num_output_tokens for o in core.step()] == [3]  # the step in flight lands; p waits
    while core.has_work():  # r0's last three tokens and p's three, in synchronous steps
        assert core.step(), "a batch holding a penalized request never leaves a step in flight"


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_an_abort_while_a_step_is_in_flight_frees_the_blocks_once_it_lands(make_engine, mode):
    core = _engine(make_engine, mode)
    for request in _requests([_greedy(40), _greedy(40)]):
        core.add_request(request)
    core.step()  # both prompts (3 and 14 tokens: 1 and 2 blocks of 8; 16 tokens fit r1's two)
    assert core.step() == []  # a decode step in flight
    free = core.stats().num_free_blocks
    assert core.abort("r0")
    aborted = core.step()  # its output first (pending), the step still in flight
    assert [(o.request_id, o.finish_reason, o.num_output_tokens) for o in aborted] == [("r0", FinishReason.ABORT, 1)]
    assert core.stats().num_free_blocks == free  # the step in flight may still write r0's K/V
    report = core.kv_report()
    assert report.problems == ()  # its blocks are counted as the step's
    assert report.num_in_use_blocks == report.num_total_blocks - free
    landed = core.step()  # the next step is launched, then the one in flight lands: r1's token only
    assert [(o.request_id, o.num_output_tokens) for o in landed] == [("r1", 2)]
    assert core.stats().num_free_blocks == free + 1  # r0's block, now the step is done
    assert core.kv_report().problems == ()
    core.abort("r1")
    while core.has_work():
        core.step()


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_a_pool_too_small_for_every_request_is_scheduled_synchronously(make_engine, mode):
    """With blocks for barely more than one request, the next step would have to preempt: the
    engine lands the step in flight first, so a preempted request is recomputed from real
    tokens, and the tokens are the synchronous engine's."""
    params = [_greedy(40), _greedy(40), _greedy(40)]
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[3]]
    config = {"num_blocks": 12, "max_model_len": 80, "enable_prefix_caching": False}
    sync = _engine(make_engine, "sync", **config)
    expected = run_to_completion(sync, {0: _requests(params, prompts)})
    core = _engine(make_engine, mode, **config)
    _assert_same(run_to_completion(core, {0: _requests(params, prompts)}), expected)
    assert sync.scheduler.num_preemptions > 0
    assert core.scheduler.num_preemptions == sync.scheduler.num_preemptions


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_a_step_that_fails_while_another_is_in_flight_loses_no_block(make_engine, mode):
    """The next step's forward raises with a step in flight: ``abort_all`` (what the engine
    thread does after a failed step) waits for the one in flight and frees every block."""
    core = _engine(make_engine, mode)
    for request in _requests([_greedy(20), _greedy(20), _greedy(20)]):
        core.add_request(request)
    core.step()  # the prompts
    assert core.step() == []  # a decode step in flight
    assert core.abort("r2")  # its blocks wait for that step

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    core.runner.execute = broken
    assert [o.finish_reason for o in core.step()] == [FinishReason.ABORT]  # r2's output first
    with pytest.raises(RuntimeError, match="injected"):
        core.step()
    core.abort_all()
    assert not core.has_work()
    report = core.kv_report()
    assert report.problems == () and report.num_in_use_blocks == 0


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_a_full_batch_goes_on_in_flight_while_a_request_waits_for_room(make_engine, mode):
    """With ``max_num_seqs`` requests running, a waiting request cannot be admitted anyway: the
    steps stay in flight until one ends, then its prompt runs and they go on again."""
    params, prompts = [_greedy(6), _greedy(14), _greedy(9)], PROMPTS[:3]
    sync = _engine(make_engine, "sync", max_num_seqs=2)
    expected = run_to_completion(sync, {0: _requests(params, prompts)})
    core = _engine(make_engine, mode, max_num_seqs=2)
    steps = []
    core.step = _counted(core.step, steps)
    _assert_same(run_to_completion(core, {0: _requests(params, prompts)}), expected)
    assert steps.count(0) == 2  # from r0 and r1's first decode step on; from r1 and r2's after r2's prompt
