"""``prompt_logprobs``: every prompt token's log-probability (after the first), against the
model's own full forward, whole or in chunks, with the prompt's blocks already cached."""

from __future__ import annotations

import pytest
import torch

from engine.params import SamplingParams
from tests.engine.conftest import run_to_completion
from workloads.corpus import prompt_of_length

TOP = 3


def _reference(loaded, prompt: list[int]) -> torch.Tensor:
    """log-softmax of transformers' own forward at every prompt position but the last: ``[n - 1, vocab]``."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _scored(core, prompt: list[int], request_id: str, max_tokens: int = 3):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=TOP, logprobs=1)
    request = core.make_request(prompt, sampling, request_id=request_id)
    return run_to_completion(core, {0: [request]})[request_id]


def _check(entries, prompt: list[int], reference: torch.Tensor) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    expected = reference.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), expected, atol=2e-3)
    best = reference.argmax(dim=-1).tolist()
    assert [e.top[0][0] for e in entries] == best
    assert all(len(e.top) == TOP for e in entries)
    # vLLM's rank (1: the most likely): where the token stands among the alternatives, else past
    # them; here the same as the reference's count of tokens at least as likely
    for e in entries:
        ids = [t for t, _ in e.top]
        assert e.rank == ids.index(e.token_id) + 1 if e.token_id in ids else e.rank > TOP
    ranks = (reference >= expected[:, None]).sum(dim=1).tolist()
    assert [e.rank for e in entries] == ranks and max(ranks) > TOP


def test_prompt_logprobs_match_the_models_forward_whole_chunked_and_after_a_cached_prefix(
    smol, smol_reference, make_engine
):
    prompt = prompt_of_length(smol.tokenizer, 300, offset=5)
    reference = _reference(smol_reference, prompt)
    whole = _scored(make_engine(smol), prompt, "whole")
    assert whole[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in whole[1:])
    _check(whole[0].prompt_logprobs, prompt, reference)

    core = make_engine(smol, max_num_batched_tokens=64, enable_chunked_prefill=True)
    plain = core.make_request(prompt, SamplingParams(max_tokens=2, temperature=0), request_id="fills-the-cache")
    first = run_to_completion(core, {0: [plain]})["fills-the-cache"]
    assert first[0].prompt_logprobs is None
    chunked = _scored(core, prompt, "chunked")
    assert chunked[0].num_cached_tokens == 0  # scored positions are computed, never taken from the cache
    again = core.make_request(prompt, SamplingParams(max_tokens=1, temperature=0), request_id="hits-the-cache")
    assert run_to_completion(core, {0: [again]})["hits-the-cache"][0].num_cached_tokens == 288  # 18 full blocks
    _check(chunked[0].prompt_logprobs, prompt, reference)
    # the generated tokens and their own log-probabilities are those of a request without prompt_logprobs
    assert [t for o in chunked for t in o.token_ids] == [t for o in whole for t in o.token_ids]


def test_a_one_token_prompt_has_no_prompt_logprobs_to_give(smol, make_engine):
    (out,) = _scored(make_engine(smol), [smol.tokenizer.encode("Hi")[0]], "one", max_tokens=1)
    assert out.prompt_logprobs == ()


def test_a_prefill_only_or_decode_request_cannot_score_its_prompt(smol, make_engine):
    core = make_engine(smol)
    request = core.make_request("Hello there", SamplingParams(max_tokens=2, prompt_logprobs=0))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        core.add_prefill(request)
    assert not core.has_work()
