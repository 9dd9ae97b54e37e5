"""Penalties, ``logit_bias`` and ``stop`` limits: their effect against the model's own logits.

The engine's logprobs are the raw model distribution (before bias and penalties), so a
run's own logprobs tell what the processed argmax must have been at every step: a
log-probability differs from the logit by a constant per step, and bias and presence or
frequency penalties are additive.
"""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch

from engine.params import FieldError, FinishReason, GenerationRequest, Role, SamplingParams, bad_word_ids
from engine.sampling import TokenHistory, apply_allowed_tokens, apply_logit_bias, apply_penalties
from tests.engine.conftest import run_to_completion
from tests.engine.test_roles import _handover

PROMPT = "Write a short poem about the sea, the waves and the sea birds."
TOP = 20  # logprobs asked for: the candidates a step's processed argmax is read from


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _tops(outputs) -> list[dict[int, float]]:
    return [dict(lp.top) for o in outputs for lp in o.logprobs]


def _run(core, request) -> list:
    return run_to_completion(core, {0: [request]})[request.request_id]


def _predicted(top: dict[int, float], counts: Counter, sp: SamplingParams) -> int | None:
    """The processed argmax from a step's raw top-20, or None when it may lie outside them."""
    bias = dict(sp.logit_bias)

    def adjusted(t: int) -> float:
        c = counts[t]
        return top[t] + bias.get(t, 0.0) - sp.presence_penalty * (c > 0) - sp.frequency_penalty * c

    best = max(top, key=adjusted)
    floor = min(top.values()) + max(bias.values(), default=0.0)  # any token outside the top-20 is below
    return best if adjusted(best) > floor else None


def _check_every_step(tokens: list[int], tops: list[dict[int, float]], sp: SamplingParams, first_counts=None) -> int:
    """Each token is the processed argmax of its step; returns the steps where the penalty
    moved the argmax away from the raw one."""
    counts, moved = Counter(first_counts or {}), 0
    for step, (token, top) in enumerate(zip(tokens, tops)):
        predicted = _predicted(top, counts, sp)
        assert predicted is None or token == predicted, (step, token, predicted)
        moved += predicted is not None and predicted != max(top, key=top.get)
        counts[token] += 1
    return moved


def test_logit_bias_moves_the_greedy_argmax_and_logprobs_stay_raw(smol, make_engine):
    core = make_engine(smol)
    plain = core.make_request(PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP))
    (out,) = _run(core, plain)
    ranked = [t for t, _ in out.logprobs[0].top]
    fifth, best = ranked[4], ranked[0]
    assert out.token_ids == (best,)
    boosted = core.make_request(
        PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP, logit_bias={fifth: 100})
    )
    (got,) = _run(core, boosted)
    assert got.token_ids == (fifth,)
    assert got.logprobs[0].logprob == pytest.approx(dict(out.logprobs[0].top)[fifth], abs=1e-4)  # raw, not biased
    banned = core.make_request(PROMPT, SamplingParams(max_tokens=1, temperature=0, logit_bias={str(best): -100}))
    assert _run(core, banned)[0].token_ids == (ranked[1],)


def test_logit_bias_applies_to_sampled_requests(smol, make_engine):
    core = make_engine(smol)
    only = {17: 100.0}
    request = core.make_request(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=only))
    assert _tokens(_run(core, request)) == [17] * 6


def test_allowed_token_ids_are_the_only_tokens_greedy_or_sampled(smol, make_engine):
    """vLLM's allowed_token_ids: the greedy token is the best of them by the raw logits, sampled
    ones stay among them; a min_tokens hold-back that would leave none of them is skipped."""
    core = make_engine(smol)
    (out,) = _run(core, core.make_request(PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP)))
    ranked = [t for t, _ in out.logprobs[0].top]
    allowed = [ranked[7], ranked[3], 17]
    for name, sampling in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 1.5, "seed": 5})):
        sp = SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=allowed, **sampling)
        tokens = _tokens(_run(core, core.make_request(PROMPT, sp)))
        assert len(tokens) == 8 and set(tokens) <= set(allowed), name
        assert name == "sampled" or tokens[0] == ranked[3]
    eos = smol.tokenizer.eos_token_id
    ended = _run(core, core.make_request(PROMPT, SamplingParams(max_tokens=5, allowed_token_ids=[eos], min_tokens=3)))
    assert (_tokens(ended), ended[-1].finish_reason) == ([eos], FinishReason.STOP)
    logits = torch.zeros(2, 4)
    apply_allowed_tokens(logits, [torch.tensor([2, 0]), None])
    assert logits.tolist() == [[0.0, float("-inf"), 0.0, float("-inf")], [0.0] * 4]


def test_bad_words_never_end_the_output_alone_or_inside_the_text(smol, make_engine):
    """vLLM's bad_words, as token sequences (each word as it starts a text and after a space):
    a word's last token is never sampled where the output ends with the rest of it."""
    assert bad_word_ids(smol.tokenizer, ["Paris", "capital of"]) == ((38634,), (7042,), (29721, 282), (3575, 282))
    core = make_engine(smol)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    plain = _tokens(_run(core, core.make_request(chat, SamplingParams(max_tokens=12, temperature=0))))
    assert smol.tokenizer.decode(plain) == "The capital of France is Paris.<|im_end|>"
    words = bad_word_ids(smol.tokenizer, ["Paris", "capital of"])
    sp = SamplingParams(max_tokens=12, temperature=0, bad_words_token_ids=words)
    tokens = _tokens(_run(core, core.make_request(chat, sp)))
    assert tokens[:2] == plain[:2] and tokens[2] != plain[2]  # " capital" came, " of" may not follow it
    text = smol.tokenizer.decode(tokens)
    assert "Paris" not in text and "capital of" not in text
    for word in words:
        assert not any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens))), word


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=40, temperature=0, logprobs=TOP, presence_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, logprobs=TOP, frequency_penalty=1.5, ignore_eos=True),
    ],
    ids=["presence", "frequency"],
)
def test_penalties_move_the_argmax_off_repeated_tokens(smol, make_engine, sp):
    """Batched with an unpenalized request: that row gives the same tokens as alone."""
    core = make_engine(smol)
    plain_sp = SamplingParams(max_tokens=40, temperature=0, logprobs=TOP, ignore_eos=True)
    alone = _tokens(_run(core, core.make_request(PROMPT, plain_sp)))
    plain = core.make_request(PROMPT, plain_sp, request_id="plain")
    penalized = core.make_request(PROMPT, sp, request_id="penalized")
    outputs = run_to_completion(core, {0: [plain, penalized]})
    assert _tokens(outputs["plain"]) == alone
    got = _tokens(outputs["penalized"])
    assert got != alone
    assert _check_every_step(got, _tops(outputs["penalized"]), sp) >= 1
    assert max(Counter(got).values()) < max(Counter(alone).values())


def test_repetition_penalty_divides_a_prompt_tokens_logit(smol, smol_reference, make_engine):
    """The prompt's own next token is its top-1 and already in it: the penalty moves it."""
    core = make_engine(smol)
    request = core.make_request("one two three one two three one two three one two", SamplingParams())
    with torch.inference_mode():
        logits = smol_reference.model(torch.tensor([request.prompt_token_ids])).logits[0, -1].float()
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[list(request.prompt_token_ids)] = True
    raw_best = int(logits.argmax())
    assert seen[raw_best] and logits[raw_best] > 0
    penalty = 2.0
    expected = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    sp = SamplingParams(max_tokens=1, temperature=0, repetition_penalty=penalty)
    (out,) = _run(core, GenerationRequest("rep", request.prompt_token_ids, sp))
    assert out.token_ids == (int(expected.argmax()),) and out.token_ids != (raw_best,)


def test_batched_processing_touches_only_the_rows_that_ask():
    """The pure functions on a 3-row batch: bias added, prompt logits divided (positive) or
    multiplied (negative) by the repetition penalty, presence and frequency subtracted."""
    logits = torch.tensor([[4.0, -3.0, 1.0, 0.5], [4.0, -3.0, 1.0, 0.5], [4.0, -3.0, 1.0, 0.5]])
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 1.0}),
        SamplingParams(logit_bias={"2": -1.0}),
    ]
    history = TokenHistory.build(params[1], [0, 1], torch.device("cpu"))
    for token in (2, 2):
        history.add(token)
    apply_logit_bias(logits, params)
    apply_penalties(logits, params, [None, history, None])
    assert logits[0].tolist() == [4.0, -3.0, 1.0, 0.5]
    # token 2 was generated twice: 1.0 / 2 (repetition) - 0.5 (presence) - 0.25 * 2 (frequency)
    assert logits[1].tolist() == [2.0, -6.0, -0.5, 1.5]
    assert logits[2].tolist() == [4.0, -3.0, 0.0, 0.5]
    assert TokenHistory.build(params[2], [0], torch.device("cpu")) is None  # no penalty: nothing kept


def test_fields_are_checked_and_pickle(smol, make_engine):
    with pytest.raises(FieldError, match="^stop must be at most 4 strings, got 5") as info:
        SamplingParams(stop=["a", "b", "c", "d", "e"])
    assert info.value.param == "stop"
    assert SamplingParams(stop=["a", "b", "c", "d"]).stop == ("a", "b", "c", "d")
    for kwargs, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"json_schema": "[1]"}, "response_format"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words"),
        ({"allowed_token_ids": [1], "json_schema": '{"type": "object"}'}, "allowed_token_ids"),
    ]:
        with pytest.raises(FieldError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == param, kwargs
    sp = SamplingParams(presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"7": 3, 2: -1})
    assert sp.logit_bias == ((2, -1.0), (7, 3.0))
    assert pickle.loads(pickle.dumps(sp)) == sp  # plain data: crosses Ray as it is
    core = make_engine(smol, max_model_len=128, num_blocks=16)
    vocab = core.vocab_size
    for admit in (core.add_request, core.add_prefill):
        for field, sampling in (
            ("logit_bias", {"logit_bias": {vocab: 5}}),
            ("allowed_token_ids", {"allowed_token_ids": [vocab]}),
            ("bad_words", {"bad_words_token_ids": [[1, vocab]]}),
        ):
            bad = GenerationRequest(f"oov-{admit.__name__}", (1, 2), SamplingParams(**sampling))
            with pytest.raises(FieldError, match=f"^{field}: token id {vocab} is out of vocabulary") as info:
                admit(bad)
            assert info.value.param == field
    assert core.stats().num_free_blocks == 16 and not core.has_work()


def test_penalties_hold_across_the_prefill_decode_handover(smol, make_engine):
    """The first token, sampled on the prefill replica, counts for the decode replica's
    penalties (it rebuilds them from the request and that token): same tokens as one engine."""
    penalties = {"frequency_penalty": 1.0, "presence_penalty": 0.5}
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=TOP, ignore_eos=True, **penalties)
    both = make_engine(smol)
    request = both.make_request("1, 2, 3, 4, 5, 6,", sp, request_id="pd-penalties")
    whole = _run(both, request)
    prefill_core, decode_core = make_engine(smol, role=Role.PREFILL), make_engine(smol, role=Role.DECODE)
    result, outputs = _handover(prefill_core, decode_core, request)
    got = _tokens(outputs)
    assert got[0] == result.first_token and got == _tokens(whole)
    # the decode replica's own logprobs agree with penalties that counted the first token,
    # and would not have without it: the case is one where the hand-off must carry it
    assert _check_every_step(got[1:], _tops(outputs)[1:], sp, first_counts={result.first_token: 1}) >= 1
    with pytest.raises(AssertionError):
        _check_every_step(got[1:], _tops(outputs)[1:], sp)


def test_text_held_back_for_a_stop_string_is_sent_when_eos_ends_the_request(smol, make_engine):
    """A stop string that never comes holds back its length - 1 characters; EOS flushes them."""
    core = make_engine(smol)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(max_tokens=20, temperature=0, stop=["a stop string never written"])
    outputs = _run(core, core.make_request(question, sp))
    assert outputs[-1].finish_reason is FinishReason.STOP and outputs[-1].num_output_tokens == 8
    assert "".join(o.text for o in outputs) == "The capital of France is Paris."
