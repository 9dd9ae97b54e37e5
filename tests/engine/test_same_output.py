"""Greedy output of the engine against transformers' ``generate`` (see tests/same_output.py).

The default model one request at a time and in one batch, over every prompt length; the
chunked and staggered variants on the tiny model of its architecture and tokenizer (the same
prompts, a fraction of the compute: their subject is the scheduling, and the tiny model's
near one-hot attention turns any misplaced KV block into other tokens).
"""

from __future__ import annotations

import pytest

from engine.params import GenerationRequest
from tests.engine.conftest import greedy, hf_greedy, run_to_completion, tiny_loaded
from tests.same_output import assert_same_output, trace_from_outputs


def _requests(prompts: list[list[int]], prefix: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}-{i}", tuple(p), greedy()) for i, p in enumerate(prompts)]


def _check(outputs, requests, traces, exact: bool, label: str) -> None:
    for request, trace in zip(requests, traces):
        got = trace_from_outputs(outputs[request.request_id])
        assert_same_output(trace, got, exact=exact, label=f"{label} {request.request_id}")
        assert outputs[request.request_id][-1].finish_reason.value == "length"


def test_one_at_a_time_matches_generate_exactly(smol, smol_prompts, smol_hf_traces, make_engine):
    core = make_engine(smol)
    for request, trace in zip(_requests(smol_prompts, "solo"), smol_hf_traces):
        outputs = run_to_completion(core, {0: [request]})
        assert_same_output(trace, trace_from_outputs(outputs[request.request_id]), exact=True, label="solo")


def test_one_continuous_batch(smol, smol_prompts, smol_hf_traces, make_engine):
    core = make_engine(smol)
    requests = _requests(smol_prompts, "batch")
    _check(run_to_completion(core, {0: requests}), requests, smol_hf_traces, exact=False, label="batch")


def test_chunked_prefill(tiny_served, smol_prompts, tiny_hf_traces, make_engine):
    core = make_engine(tiny_served.loaded, enable_chunked_prefill=True, max_num_batched_tokens=192)
    requests = _requests(smol_prompts, "chunked")
    _check(run_to_completion(core, {0: requests}), requests, tiny_hf_traces, exact=False, label="chunked")


def test_requests_arriving_while_others_decode(tiny_served, smol_prompts, tiny_hf_traces, make_engine):
    core = make_engine(tiny_served.loaded, enable_chunked_prefill=True, max_num_batched_tokens=512)
    requests = _requests(smol_prompts, "arrive")
    arrivals = {3 * i: [r] for i, r in enumerate(requests)}
    _check(run_to_completion(core, arrivals), requests, tiny_hf_traces, exact=False, label="arrivals")


def test_preemption_under_a_tiny_pool_keeps_greedy_tokens(smol, smol_prompts, smol_hf_traces, make_engine):
    # 15 blocks of 16 tokens; prompts of 9, 37 and 120 tokens take 1 + 3 + 8 = 12 blocks at
    # admission and 3 + 5 + 10 = 18 after 32 tokens each: the newest request is preempted
    # and recomputed while the older ones grow.
    core = make_engine(smol, max_model_len=240, num_blocks=15)
    picked = [1, 2, 3]
    requests = _requests([smol_prompts[i] for i in picked], "preempt")
    outputs = run_to_completion(core, {0: requests})
    assert core.stats().num_preemptions > 0, "the pool was meant to be too small for all requests at once"
    _check(outputs, requests, [smol_hf_traces[i] for i in picked], exact=False, label="preempt")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_random_families(family, make_engine):
    loaded, reference = tiny_loaded(family)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((1, 5, 40, 130, 300))]
    traces = [hf_greedy(reference, p) for p in prompts]
    core = make_engine(loaded, max_model_len=512, block_size=8)
    for request, trace in zip(_requests(prompts, f"{family}-solo"), traces):
        got = trace_from_outputs(run_to_completion(core, {0: [request]})[request.request_id])
        assert_same_output(trace, got, exact=True, label=family)
    requests = _requests(prompts, f"{family}-batch")
    _check(run_to_completion(core, {0: requests}), requests, traces, exact=False, label=family)
