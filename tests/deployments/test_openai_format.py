"""Engine outputs -> OpenAI bodies, log-probabilities included (pure functions, real tokenizer)."""

from __future__ import annotations

import json

import pytest

from deployments.openai_format import CHAT, COMPLETION, ChunkWriter, full_response, token_text_of
from engine.loader import ModelSpec, load_tokenizer
from engine.params import FinishReason, RequestOutput, TokenLogprobs


@pytest.fixture(scope="module")
def text_of():
    return token_text_of(load_tokenizer(ModelSpec()))


@pytest.fixture(scope="module")
def outputs(text_of):
    tokenizer = load_tokenizer(ModelSpec())
    ids = tokenizer("Paris is", add_special_tokens=False)["input_ids"]
    assert len(ids) == 2
    entries = [TokenLogprobs(i, -0.5 * (k + 1), ((i, -0.5 * (k + 1)), (i + 1, -3.0))) for k, i in enumerate(ids)]
    common = {"request_id": "r", "num_prompt_tokens": 4}
    first = RequestOutput(
        **common, token_ids=(ids[0],), text=text_of(ids[0]), finished=False, num_output_tokens=1, logprobs=(entries[0],)
    )
    # the second token's text held back (as for part of a character), then sent with the end
    held = RequestOutput(
        **common, token_ids=(ids[1],), text="", finished=False, num_output_tokens=2, logprobs=(entries[1],)
    )
    last = RequestOutput(
        **common,
        token_ids=(),
        text=text_of(ids[1]),
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_output_tokens=2,
    )
    return ids, entries, [first, held, last]


def test_completion_logprobs(outputs, text_of):
    ids, entries, outs = outputs
    body = full_response(COMPLETION, "r", "m", outs, text_of)
    logprobs = body["choices"][0]["logprobs"]
    tokens = [text_of(i) for i in ids]
    assert "".join(tokens) == body["choices"][0]["text"] == "Paris is"
    assert logprobs["tokens"] == tokens and logprobs["token_logprobs"] == [-0.5, -1.0]
    assert logprobs["text_offset"] == [0, len(tokens[0])]
    assert logprobs["top_logprobs"][1] == {tokens[1]: -1.0, text_of(ids[1] + 1): -3.0}
    assert full_response(COMPLETION, "r", "m", outs)["choices"][0]["logprobs"] is None


def test_chat_logprobs(outputs, text_of):
    ids, _, outs = outputs
    content = full_response(CHAT, "r", "m", outs, text_of)["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [text_of(i) for i in ids]
    assert content[0]["bytes"] == list(text_of(ids[0]).encode()) and content[0]["logprob"] == -0.5
    assert [t["logprob"] for t in content[1]["top_logprobs"]] == [-1.0, -3.0]


@pytest.mark.parametrize("fmt", [CHAT, COMPLETION], ids=["chat", "completion"])
def test_streamed_chunks_carry_each_tokens_logprobs_once(outputs, text_of, fmt):
    ids, _, outs = outputs
    writer = ChunkWriter(fmt, "r", "m", text_of)
    chunks = [writer.delta(o) for o in outs]
    assert chunks[1] is None  # no text yet: its log-probabilities wait for the next chunk
    bodies = [json.loads(c.decode().removeprefix("data: ")) for c in chunks if c]
    if fmt is CHAT:
        tokens = [[c["token"] for c in b["choices"][0]["logprobs"]["content"]] for b in bodies]
    else:
        tokens = [b["choices"][0]["logprobs"]["tokens"] for b in bodies]
        assert bodies[1]["choices"][0]["logprobs"]["text_offset"] == [len(text_of(ids[0]))]
    assert tokens == [[text_of(ids[0])], [text_of(ids[1])]]
