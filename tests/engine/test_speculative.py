"""Speculative decoding by prompt lookup (``engine.speculative``): exact greedy output, the
accept/resample step's distribution, the KV given back after rejections, and every sampling
field held at each verified position."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from pydantic import ValidationError

from app.settings import AppConfig
from engine.config import SpeculativeConfig
from engine.core import EngineCore
from engine.params import GenerationRequest, SamplingParams
from engine.sampling import verify_token
from engine.speculative import propose_ngram
from tests.engine.conftest import greedy, hf_greedy, run_to_completion, tiny_loaded
from tests.same_output import assert_same_alternatives, assert_same_output, trace_from_outputs
from workloads.corpus import prompt_of_length

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _spec(**overrides: object) -> SpeculativeConfig:
    return SpeculativeConfig(**{**NGRAM, "disable_by_batch_size": 64, **overrides})


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _p_value(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def _check_blocks(core: EngineCore) -> None:
    """After a step: each running sequence holds exactly the blocks its computed tokens need."""
    for seq in core.scheduler.running:
        assert len(seq.block_ids) == core.allocator.blocks_needed(seq.num_computed_tokens), seq.request_id
    assert core.kv_report().ok, core.kv_report().problems


def test_propose_ngram_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 2, 4, 3) == (7, 8, 5)  # "2 3" last seen before the end at 5..6
    assert propose_ngram([5, 1, 2, 6, 0, 1, 2, 8, 1, 2], 1, 2, 2) == (8, 1)
    assert propose_ngram([4, 5, 6, 7], 2, 3, 4) == ()  # no earlier occurrence
    assert propose_ngram([3, 4, 3, 4], 2, 2, 5) == (3, 4)  # the continuation runs to the end
    assert propose_ngram([3, 4, 3, 4], 2, 2, 0) == ()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative.prompt_lookup_min"),
        ({"method": "eagle"}, "method"),
    ],
)
def test_bad_settings_are_refused_at_start_naming_the_field(fields, named):
    with pytest.raises(ValidationError) as caught:
        AppConfig.load({f"speculative.{k}": str(v) for k, v in fields.items()})
    assert named in str(caught.value) and "speculative" in str(caught.value)


def test_greedy_batch_1_is_transformers_token_for_token(smol, smol_prompts, smol_hf_traces, make_engine):
    core = make_engine(smol, speculative=_spec())
    for i in (1, 2, 3, 4):  # corpus text (it repeats paragraphs: proposals accepted) and a chat question
        request = GenerationRequest(f"solo-{i}", tuple(smol_prompts[i]), greedy())
        outputs = run_to_completion(core, {0: [request]})[request.request_id]
        assert_same_output(smol_hf_traces[i], trace_from_outputs(outputs), exact=True, label=f"prompt {i}")
    counters = core.spec_counters
    assert counters.num_accepted_tokens > 0, counters
    assert counters.num_draft_tokens > counters.num_accepted_tokens, "no proposal was ever rejected"


def test_a_batch_of_16_with_rows_that_do_not_speculate(smol, smol_prompts, smol_hf_traces, make_engine):
    """16 requests arriving while others decode, chunked prompts in the same steps; the corpus
    ones copy text (proposals), the chat ones mostly do not. Compared by tests/same_output.py's
    batched rule (float32 kernels differ between batch shapes), not token for token. All six
    prompts, the longest (640 tokens) in three chunks of 256."""
    core = make_engine(smol, speculative=_spec(), enable_chunked_prefill=True, max_num_batched_tokens=256)
    picked = [i % 6 for i in range(16)]
    requests = [GenerationRequest(f"b-{n}", tuple(smol_prompts[i]), greedy()) for n, i in enumerate(picked)]
    outputs = run_to_completion(core, {step: requests[4 * step : 4 * step + 4] for step in range(4)})
    for request, i in zip(requests, picked):
        got = trace_from_outputs(outputs[request.request_id])
        assert_same_output(smol_hf_traces[i], got, exact=False, label=request.request_id)
    assert core.spec_counters.num_accepted_tokens > 0


@pytest.mark.parametrize("block_size", [2, 4])
def test_rejected_proposals_give_their_blocks_back(block_size, make_engine):
    """A tiny random model (it falls into loops that lookup predicts, and leaves them): after
    every step each sequence holds exactly the blocks of its accepted tokens, and the tokens are
    transformers' own."""
    loaded, reference = tiny_loaded("llama")
    prompts = [[(5 * i + 11 * j) % 97 + 1 for j in range(n)] for i, n in enumerate((7, 30, 61))]
    expected = [hf_greedy(reference, p, 48) for p in prompts]  # before the engine: the two share a config
    core = make_engine(loaded, speculative=_spec(prompt_lookup_min=1), max_model_len=256, block_size=block_size)
    requests = [GenerationRequest(f"r{i}", tuple(p), greedy(48)) for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while core.has_work():
        for out in core.step():
            outputs[out.request_id].append(out)
        _check_blocks(core)
    counters = core.spec_counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, counters
    for request, trace in zip(requests, expected):
        assert_same_output(
            trace, trace_from_outputs(outputs[request.request_id]), exact=False, label=request.request_id
        )


def test_prefix_cache_holds_only_accepted_tokens(smol, smol_prompts, make_engine):
    """The KV a speculating request leaves in the prefix cache is its accepted tokens': a prompt
    that extends it continues exactly as an engine without a cache or speculation."""
    core = make_engine(smol, speculative=_spec())
    first = GenerationRequest("first", tuple(smol_prompts[3]), greedy(40))
    text = smol_prompts[3] + _tokens(run_to_completion(core, {0: [first]})["first"])
    second = GenerationRequest("second", tuple(text), greedy(16))
    got = run_to_completion(core, {0: [second]})["second"]
    assert got[0].num_cached_tokens >= len(text) - 2 * core.config.block_size
    plain = make_engine(smol, enable_prefix_caching=False)
    assert _tokens(got) == _tokens(run_to_completion(plain, {0: [second]})["second"])


def test_preemption_under_a_tiny_pool_with_speculation(smol, smol_prompts, smol_hf_traces, make_engine):
    core = make_engine(smol, speculative=_spec(), max_model_len=240, num_blocks=15)
    picked = [1, 2, 3]
    requests = [GenerationRequest(f"p{i}", tuple(smol_prompts[i]), greedy()) for i in picked]
    outputs = run_to_completion(core, {0: requests})
    assert core.stats().num_preemptions > 0
    for request, i in zip(requests, picked):
        assert_same_output(
            smol_hf_traces[i], trace_from_outputs(outputs[request.request_id]), exact=False, label=str(i)
        )


def test_a_fully_masked_row_keeps_its_proposal_instead_of_failing_the_step():
    """Probabilities that are all NaN (a row whose every logit was masked): no error, which
    would fail every request on the engine."""
    assert verify_token(torch.full((8,), float("nan")), 3, torch.Generator().manual_seed(0)) == 3


@pytest.mark.parametrize("one_hot", [True, False])
def test_accept_or_resample_keeps_the_target_distribution(one_hot):
    """The step itself, 20,000 draws: the tokens it returns follow the target, whatever the draft."""
    target = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    draft_probs = torch.tensor([0.40, 0.05, 0.25, 0.05, 0.05, 0.20])
    generator = torch.Generator().manual_seed(7)
    draws = 20_000
    counts = Counter()
    accepted = 0
    for _ in range(draws):
        draft = 2 if one_hot else int(torch.multinomial(draft_probs, 1, generator=generator))
        token = verify_token(target, draft, generator, None if one_hot else draft_probs)
        counts[token] += 1
        accepted += token == draft
    expected = target * draws
    statistic = sum((counts[i] - float(expected[i])) ** 2 / float(expected[i]) for i in range(len(target)))
    assert _p_value(statistic, len(target) - 1) > 1e-3, (counts, statistic)
    if one_hot:  # a sure proposal is kept with its target probability
        assert abs(accepted / draws - 0.10) < 0.01


def test_seeded_sampling_matches_the_sampler_without_speculation(make_engine):
    """2,000 seeded requests, proposals verified at the second token (the prompt holds every
    token, so any first token has a continuation): the first two tokens' joint distribution
    matches an engine without speculation, and a seed reproduces its output."""
    loaded, _ = tiny_loaded("llama", seed=3)
    prompt = tuple(torch.randperm(512, generator=torch.Generator().manual_seed(0)).tolist())
    sampling = {"max_tokens": 3, "temperature": 1.0, "top_k": 4, "ignore_eos": True}
    engines = {
        "spec": make_engine(loaded, speculative=_spec(prompt_lookup_min=1), max_model_len=600),
        "plain": make_engine(loaded, max_model_len=600),
    }
    joint = {}
    for name, core in engines.items():
        requests = [GenerationRequest(f"s{n}", prompt, SamplingParams(seed=n, **sampling)) for n in range(2000)]
        outputs = run_to_completion(core, {0: requests})
        joint[name] = Counter(tuple(_tokens(outputs[r.request_id])[:2]) for r in requests)
    assert engines["spec"].spec_counters.num_drafts >= 1000, engines["spec"].spec_counters
    cells = sorted(set(joint["spec"]) | set(joint["plain"]))
    statistic = sum((joint["spec"][c] - joint["plain"][c]) ** 2 / (joint["spec"][c] + joint["plain"][c]) for c in cells)
    assert _p_value(statistic, len(cells) - 1) > 1e-3, (joint, statistic)
    again = GenerationRequest("again", prompt, SamplingParams(seed=11, **{**sampling, "max_tokens": 24}))
    runs = [_tokens(run_to_completion(engines["spec"], {0: [again]})["again"]) for _ in range(2)]
    assert runs[0] == runs[1]


SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6}},
    "required": ["items"],
    "additionalProperties": False,
}
FRUIT = (
    "Fruit lists as JSON:\n"
    + '{"items": ["apple", "pear", "plum", "cherry"]}\n{"items": ["fig", "lime", "kiwi"]}\n' * 2
    + "Another list:\n"
)


@pytest.mark.parametrize(
    "fields",
    [
        {"json_schema": json.dumps(SCHEMA)},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2},
        {"logit_bias": {198: -100.0}, "min_tokens": 20, "stop": ("Paris",), "logprobs": 3},
    ],
    ids=["grammar", "penalties", "bias-min-stop-logprobs"],
)
def test_sampling_fields_hold_at_every_verified_position(fields, smol, make_engine):
    """Greedy with each field: the same tokens, text, finish and logprobs as without speculation
    (the lists to copy in the prompt give proposals; the grammar refuses some past ``maxItems``)."""
    # penalties steer the model off copying lists: a corpus slice still gives it proposals
    text = prompt_of_length(smol.tokenizer, 300, offset=51) if "frequency_penalty" in fields else None
    prompt = tuple(text or smol.tokenizer(FRUIT)["input_ids"])
    sampling = SamplingParams(max_tokens=48, temperature=0, **fields)
    runs = {}
    for name, spec in (("spec", _spec(prompt_lookup_min=1)), ("plain", SpeculativeConfig())):
        core = make_engine(smol, speculative=spec)
        runs[name] = run_to_completion(core, {0: [GenerationRequest("f", prompt, sampling)]})["f"]
        if name == "spec":
            assert core.spec_counters.num_drafts > 0, "no proposal was verified"
    spec, plain = runs["spec"], runs["plain"]
    assert _tokens(spec) == _tokens(plain)
    assert "".join(o.text for o in spec) == "".join(o.text for o in plain)
    assert spec[-1].finish_reason == plain[-1].finish_reason
    for a, b in zip([lp for o in spec for lp in o.logprobs], [lp for o in plain for lp in o.logprobs]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
        assert_same_alternatives(a.top, b.top, tol=1e-3)
