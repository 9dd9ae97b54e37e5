"""Speculative decoding on CUDA: verify steps and decode steps, both replayed from CUDA graphs,
give transformers' greedy tokens (tests/same_output.py's rule), and every block comes back. The
CPU tests of the same paths: tests/engine/test_speculative.py, tests/engine/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.params import GenerationRequest, SamplingParams
from tests.gpu.test_cuda_engine import hf_greedy, make_engine, run_to_completion, tiny_pair  # noqa: F401
from tests.same_output import assert_same_output
from tests.same_output import trace_from_outputs as trace_of

pytestmark = pytest.mark.cuda

# a tiny random model falls into loops that prompt lookup predicts, and leaves them
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)


def test_speculative_decode_on_cuda_gives_the_greedy_tokens(cuda, make_engine):  # noqa: F811
    loaded, reference = tiny_pair("llama", torch.float32, cuda)
    prompts = [[(5 * i + 11 * j) % 97 + 1 for j in range(n)] for i, n in enumerate((7, 30, 61))]
    prompts.append([1, 2, 3, 4, 5, 6] * 8)  # a phrase that repeats: proposals from the first step on
    expected = [hf_greedy(reference, p) for p in prompts]
    core = make_engine(loaded, speculative=SPEC, max_num_seqs=4)
    assert core.runner.graphs is not None  # plain decode steps still replay from graphs
    sampling = SamplingParams(max_tokens=len(expected[0].tokens), temperature=0, ignore_eos=True, logprobs=5)
    batch = [GenerationRequest(f"spec-{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
    outputs = run_to_completion(core, batch)
    counters = core.spec_counters
    assert counters.num_drafts > 0 and counters.num_draft_tokens >= counters.num_accepted_tokens, counters
    assert any(key.num_queries > 1 for key in core.runner.graphs.captured)  # verify steps replayed
    for request, trace in zip(batch, expected):
        assert_same_output(trace, trace_of(outputs[request.request_id]), exact=False, label=request.request_id)
