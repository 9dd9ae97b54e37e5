"""The one definition of "same output" every test uses.

Requests run one at a time must match transformers' greedy ``generate`` token for token.
Batched, chunked or packed runs must match up to the first divergence, and at that
divergence each side's token must be among the other side's top-5 tokens (float32
kernels differ slightly between batch shapes; vLLM's tests use the same rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_COMPARED_TOKENS = 32
TOP_N = 5


@dataclass(frozen=True)
class GreedyTrace:
    """Generated tokens and, per position, the top-5 token ids of the distribution."""

    tokens: tuple[int, ...]
    top: tuple[tuple[int, ...], ...]


def hf_greedy(model, prompt: list[int], num_tokens: int = MIN_COMPARED_TOKENS) -> GreedyTrace:
    """transformers' own greedy ``generate`` of ``num_tokens`` tokens (EOS ignored), on the
    model's device: the reference every engine run is compared with."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return trace_from_logits(out.sequences[0, len(prompt) :].tolist(), out.scores)


def trace_from_logits(tokens: Sequence[int], logits: Sequence[torch.Tensor]) -> GreedyTrace:
    # rows of one sequence: ``generate``'s scores are ``[1, vocab]`` each
    top = tuple(tuple(torch.topk(row.float().flatten(), TOP_N).indices.tolist()) for row in logits)
    return GreedyTrace(tuple(tokens), top)


def trace_from_outputs(outputs: Sequence) -> GreedyTrace:
    """From engine ``RequestOutput``s of a request run with ``logprobs=5``."""
    tokens = [t for o in outputs for t in o.token_ids]
    top = [tuple(t for t, _ in lp.top) for o in outputs for lp in o.logprobs]
    return GreedyTrace(tuple(tokens), tuple(top))


def first_divergence(expected: GreedyTrace, actual: GreedyTrace) -> int | None:
    for i, (a, b) in enumerate(zip(expected.tokens, actual.tokens)):
        if a != b:
            return i
    return None


def assert_same_output(expected: GreedyTrace, actual: GreedyTrace, exact: bool, label: str = "") -> None:
    assert len(expected.tokens) >= MIN_COMPARED_TOKENS, f"{label}: only {len(expected.tokens)} reference tokens"
    assert len(actual.tokens) == len(expected.tokens), (
        f"{label}: {len(actual.tokens)} tokens, expected {len(expected.tokens)}"
    )
    i = first_divergence(expected, actual)
    if i is None:
        return
    assert not exact, f"{label}: token {i} differs: {actual.tokens[i]} != {expected.tokens[i]} (exact run)"
    assert actual.tokens[i] in expected.top[i] and expected.tokens[i] in actual.top[i], (
        f"{label}: token {i} differs ({actual.tokens[i]} vs {expected.tokens[i]}) and is not in the other's "
        f"top-{TOP_N}: expected top {expected.top[i]}, actual top {actual.top[i]}"
    )


def assert_same_alternatives(actual: Sequence, expected: Sequence, tol: float = 1e-4, label: str = "") -> None:
    """One position's top alternatives, ``(token, logprob)`` most likely first, from two runs that
    must agree: the same likelihoods rank by rank, and a token may stand elsewhere only where it
    ties (within ``tol``) with the one it replaced or, at the cut, with the last one listed.
    float32 kernels order near-equal alternatives differently (AVX-512 CPUs unlike AVX2 ones)."""
    assert len(actual) == len(expected), f"{label}: {len(actual)} alternatives, expected {len(expected)}"
    listed, last = dict(expected), expected[-1][1]
    for rank, ((token, value), (_, expected_value)) in enumerate(zip(actual, expected)):
        assert abs(value - expected_value) <= tol, f"{label}: rank {rank}: {actual} vs {expected}"
        assert abs(value - listed.get(token, last)) <= tol, f"{label}: token {token} not tied: {actual} vs {expected}"


def engine_text_traces(loaded, prompts: Sequence[Sequence[int]], num_tokens: int, max_model_len: int = 512) -> list:
    """The engine alone, greedy with the top-5, the prompts in one batch: each prompt's trace as
    the tokens' texts (what the HTTP API returns), the reference of the served tests (compared
    by the batched rule: a server batches its requests too)."""
    from deployments.openai_format import token_text_of
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.params import GenerationRequest, SamplingParams

    core = EngineCore(loaded, EngineConfig(max_model_len=max_model_len, kv_cache_bytes=64 << 20))
    text_of = token_text_of(loaded.tokenizer)
    sampling = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=5)
    outputs: dict[str, list] = {f"ref-{i}": [] for i in range(len(prompts))}
    for request_id, prompt in zip(outputs, prompts):
        core.add_request(GenerationRequest(request_id, tuple(prompt), sampling))
    while core.has_work():
        for output in core.step():
            outputs[output.request_id].append(output)
    texts = []
    for trace in map(trace_from_outputs, outputs.values()):
        texts.append(GreedyTrace(tuple(map(text_of, trace.tokens)), tuple(tuple(map(text_of, t)) for t in trace.top)))
    return texts
