"""Bad input: a ValueError naming the field, raised before any block is allocated."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.params import GenerationRequest, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": "abc"}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_a_tiny_temperature_is_greedy(smol, make_engine):
    """Dividing logits by 1e-30 overflows them; below 1e-5 sampling is greedy (as vLLM does)."""
    core = make_engine(smol)
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=1e-5).greedy
    outputs = {}
    for name, temperature in (("tiny", 1e-30), ("zero", 0.0)):
        request = core.make_request("The capital of France is", SamplingParams(max_tokens=6, temperature=temperature))
        core.add_request(GenerationRequest(name, request.prompt_token_ids, request.sampling))
    while core.has_work():
        for output in core.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    assert outputs["tiny"] == outputs["zero"] and len(outputs["zero"]) == 6


def test_out_of_vocabulary_ids_are_refused_before_the_step(smol, make_engine):
    """An id beyond the embedding would fail inside the step, and with it the whole batch."""
    core = make_engine(smol, max_model_len=128, num_blocks=16)
    vocab = smol.model.config.vocab_size
    for admit in (core.add_request, core.add_prefill):
        with pytest.raises(ValueError, match=rf"^prompt: token id {vocab} is out of vocabulary .the model has {vocab}"):
            admit(GenerationRequest(f"oov-{admit.__name__}", (1, 2, vocab), SamplingParams(max_tokens=2)))
    assert core.stats().num_free_blocks == 16 and not core.has_work()


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_empty_or_wrong_prompt(smol, make_engine):
    core = make_engine(smol)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        core.make_request("")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        GenerationRequest("r", ())
    with pytest.raises(ValueError, match="prompt must be"):
        core.make_request([1.5, 2])
    with pytest.raises(ValueError, match="^prompt: token ids are non-negative integers, got -3$"):
        core.make_request([1, -3])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        core.make_request([{"role": "user"}])


def test_context_limits_checked_before_any_block(smol, make_engine):
    core = make_engine(smol, max_model_len=128, num_blocks=16)
    too_long = GenerationRequest("long", tuple(range(1, 129)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt is 128 tokens, the context .max_model_len. is 128"):
        core.add_request(too_long)
    beyond = GenerationRequest("beyond", tuple(range(1, 101)), SamplingParams(max_tokens=29))
    with pytest.raises(ValueError, match="^max_tokens: 29 is beyond the context: prompt 100 tokens"):
        core.add_request(beyond)
    with pytest.raises(ValueError, match="max_tokens"):
        core.add_prefill(beyond)
    ok = GenerationRequest("ok", tuple(range(1, 101)), SamplingParams(max_tokens=28, temperature=0))
    core.add_request(ok)
    with pytest.raises(ValueError, match="request_id 'ok' already exists"):
        core.add_request(ok)
    assert core.stats().num_free_blocks == 16  # nothing allocated until the step
    while core.has_work():
        core.step()


def test_kv_budget_too_small_names_the_numbers(smol):
    with pytest.raises(ValueError) as info:
        EngineCore(smol, EngineConfig(max_model_len=2048, kv_cache_bytes=10 << 20))
    message = str(info.value)
    assert "KV cache too small: 14 blocks of 16 tokens" in message
    assert "needs 128 blocks (94371840 bytes)" in message


def test_unchunked_budget_below_context_is_refused(smol):
    with pytest.raises(ValueError, match="max_num_batched_tokens=256 < max_model_len=512"):
        EngineCore(smol, EngineConfig(max_model_len=512, max_num_batched_tokens=256))
