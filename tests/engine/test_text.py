"""Detokenization, stop strings, stop tokens, EOS, seeded sampling (default model)."""

from __future__ import annotations

import pytest
import torch

from engine.detokenizer import TextStream
from engine.params import FieldError, FinishReason, GenerationRequest, SamplingParams
from engine.sampling import apply_min_p, apply_top_k, apply_top_p
from tests.engine.conftest import run_to_completion


def _run(core, prompt, **sampling):
    request = core.make_request(prompt, SamplingParams(**sampling))
    return run_to_completion(core, {0: [request]})[request.request_id]


def test_deltas_never_split_multibyte_characters(smol):
    tok = smol.tokenizer
    text = "Café ☕ naïve 日本語 🚀🚀 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, [1], ())
    deltas = [stream.push(t)[0] for t in ids] + [stream.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d])  # some tokens were partial characters


def test_stop_string_split_across_tokens_is_cut_exactly(smol):
    tok = smol.tokenizer
    ids = tok(" alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, [1], ("ta gam",))
    emitted, hit = "", False
    for t in ids:
        delta, hit = stream.push(t)
        emitted += delta
        if hit:
            break
    assert hit and emitted == " alpha be"


@pytest.mark.parametrize(
    ("stop", "kept"),
    [
        (("ta gam",), " alpha beta gam"),  # split across tokens, and what follows it in the token dropped
        (("gamma", "beta g"), " alpha beta g"),  # the one that starts first
        (("beta", "beta gamma"), " alpha beta"),  # two that start together: the first listed
    ],
)
def test_a_kept_stop_string_ends_the_text_and_nothing_after_it(smol, stop, kept):
    """vLLM's include_stop_str_in_output: the text ends with the stop string, streamed whole."""
    tok = smol.tokenizer
    stream = TextStream(tok, [1], stop, keep_stop=True)
    emitted, hit = "", False
    for t in tok(" alpha beta gamma delta", add_special_tokens=False)["input_ids"]:
        delta, hit = stream.push(t)
        emitted += delta
        if hit:
            break
    assert hit and emitted == stream.text == kept
    assert stream.flush() == ""


def test_stop_string_in_generation(smol, make_engine):
    core = make_engine(smol)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = _run(core, chat, max_tokens=20, temperature=0)
    full_text = "".join(o.text for o in full)
    assert full_text == "The capital of France is Paris."
    assert full[-1].finish_reason is FinishReason.STOP  # EOS
    cut = _run(core, chat, max_tokens=20, temperature=0, stop=["France"])
    assert "".join(o.text for o in cut) == "The capital of "
    assert cut[-1].finish_reason is FinishReason.STOP
    assert cut[-1].num_output_tokens < full[-1].num_output_tokens


def test_stop_token_ids_and_max_tokens(smol, make_engine):
    core = make_engine(smol)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = [t for o in _run(core, chat, max_tokens=20, temperature=0) for t in o.token_ids]
    stopped = _run(core, chat, max_tokens=20, temperature=0, stop_token_ids=[full[3]])
    assert [t for o in stopped for t in o.token_ids] == full[:4]
    assert stopped[-1].finish_reason is FinishReason.STOP
    outs = _run(core, chat, max_tokens=3, temperature=0)
    assert [t for o in outs for t in o.token_ids] == full[:3]
    assert (outs[-1].finish_reason, outs[-1].num_output_tokens) == (FinishReason.LENGTH, 3)
    # the stop token's text is left out, as vLLM's: the text of the three tokens before it
    assert "".join(o.text for o in stopped) == "".join(o.text for o in outs) == "The capital of"
    # unless asked to keep it (vLLM's include_stop_str_in_output), as a stop string's
    kept = _run(core, chat, max_tokens=20, temperature=0, stop_token_ids=[full[3]], include_stop_str_in_output=True)
    assert [t for o in kept for t in o.token_ids] == full[:4]
    assert "".join(o.text for o in kept) == "The capital of France"
    cut = _run(core, chat, max_tokens=20, temperature=0, stop=["France"], include_stop_str_in_output=True)
    assert ("".join(o.text for o in cut), cut[-1].finish_reason) == ("The capital of France", FinishReason.STOP)


def test_special_tokens_are_text_only_when_asked(smol, make_engine):
    """vLLM's skip_special_tokens (true by default): past an ignored EOS the chat's end-of-turn
    token is in the text only with it false; the tokens are the same."""
    core = make_engine(smol)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    sampling = dict(max_tokens=10, temperature=0, ignore_eos=True)
    skipped, kept = (_run(core, chat, skip_special_tokens=skip, **sampling) for skip in (True, False))
    assert [t for o in skipped for t in o.token_ids] == [t for o in kept for t in o.token_ids]
    text = "".join(o.text for o in kept)
    assert text.startswith("The capital of France is Paris.<|im_end|>")
    assert "".join(o.text for o in skipped) == text.replace("<|im_end|>", "").replace("<|im_start|>", "")


def test_seeded_sampling_is_reproducible_and_independent_of_batch(smol, make_engine):
    core = make_engine(smol)
    sp = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True)
    a = _run(core, "Once upon a time", seed=1234, **sp)
    b = _run(core, "Once upon a time", seed=1234, **sp)
    c = _run(core, "Once upon a time", seed=99, **sp)
    tokens = [[t for o in run for t in o.token_ids] for run in (a, b, c)]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]
    # the same seeded request next to other traffic: same tokens
    requests = [
        GenerationRequest(
            "seeded", tuple(core.make_request("Once upon a time").prompt_token_ids), SamplingParams(seed=1234, **sp)
        ),
        core.make_request("The weather today", SamplingParams(max_tokens=24, temperature=1.0)),
    ]
    batch = run_to_completion(core, {0: requests})
    assert [t for o in batch["seeded"] for t in o.token_ids] == tokens[0]


def test_top_k_top_p_and_min_p_filters():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert torch.isinf(apply_top_k(logits, 2)).tolist() == [True, False, False, True]
    probs = torch.softmax(logits, -1)  # [0.087, 0.644, 0.237, 0.032]
    kept = ~torch.isinf(apply_top_p(logits, 0.7))
    assert kept.tolist() == [False, True, True, False]
    assert (~torch.isinf(apply_top_p(logits, 0.5))).tolist() == [False, True, False, False]
    assert probs.argmax() == 1
    # min-p: kept when at least min_p x the top probability (0.644)
    assert (~torch.isinf(apply_min_p(logits, 0.1))).tolist() == [True, True, True, False]
    assert (~torch.isinf(apply_min_p(logits, 0.2))).tolist() == [False, True, True, False]
    assert (~torch.isinf(apply_min_p(logits, 1.0))).tolist() == [False, True, False, False]
    assert apply_min_p(logits, 0.0) is logits
    with pytest.raises(FieldError, match="min_p must be a finite number in"):
        SamplingParams(min_p=1.5)


def test_min_p_1_samples_the_greedy_tokens(smol, make_engine):
    """min_p 1 keeps only the most likely token: a hot sampled request gives the greedy answer."""
    core = make_engine(smol)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = [t for o in _run(core, chat, max_tokens=20, temperature=0) for t in o.token_ids]
    for seed in (1, 2):
        sampled = _run(core, chat, max_tokens=20, temperature=1.5, seed=seed, min_p=1.0)
        assert [t for o in sampled for t in o.token_ids] == greedy


@pytest.mark.parametrize("n", [1, 5])
def test_logprobs_are_returned(smol, make_engine, n):
    core = make_engine(smol)
    outs = _run(core, "Hello", max_tokens=2, temperature=0, logprobs=n)
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 2 and all(len(lp.top) == n for lp in lps)
    assert lps[0].token_id == lps[0].top[0][0] and lps[0].logprob == pytest.approx(lps[0].top[0][1])


def test_min_tokens_holds_back_eos_and_stop_ids(smol, make_engine):
    core = make_engine(smol)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = [t for o in _run(core, chat, max_tokens=20, temperature=0) for t in o.token_ids]
    assert len(full) == 8  # ends with EOS
    outs = _run(core, chat, max_tokens=20, temperature=0, min_tokens=12)
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens[:7] == full[:7] and tokens[7] != full[7] and len(tokens) >= 12
    assert not set(tokens[:12]) & set(core._eos_ids)
    with pytest.raises(ValueError, match="min_tokens must be an integer in \\[0, max_tokens\\]"):
        SamplingParams(max_tokens=4, min_tokens=5)
