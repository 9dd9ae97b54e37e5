"""Engine outputs -> OpenAI bodies, log-probabilities included (pure functions, real tokenizer)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deployments.openai_format import (
    CHAT,
    COMPLETION,
    ChunkWriter,
    Echo,
    PromptLogprobs,
    full_response,
    full_response_choices,
    token_text_of,
)
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


def _outputs(pieces: list[str], reason: FinishReason = FinishReason.STOP) -> list[RequestOutput]:
    """One output per piece of text, the last one finished."""
    last = len(pieces) - 1
    return [
        RequestOutput(
            request_id="r",
            token_ids=(i,),
            text=piece,
            finished=i == last,
            finish_reason=reason if i == last else None,
            num_prompt_tokens=4,
            num_output_tokens=i + 1,
        )
        for i, piece in enumerate(pieces)
    ]


def _events(writer: ChunkWriter, outputs: list[RequestOutput]) -> list[dict]:
    raw = b"".join(chunk for chunk in map(writer.delta, outputs) if chunk).decode()
    return [json.loads(line.removeprefix("data: ")) for line in raw.split("\n\n") if line]


@pytest.mark.parametrize("fmt", [CHAT, COMPLETION], ids=["chat", "completion"])
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(fmt):
    """vLLM's stream_options.continuous_usage_stats; without it no chunk carries usage."""
    counted = ChunkWriter(fmt, "r", "m", prompt_tokens=4)
    first = [json.loads(counted.start().decode().removeprefix("data: "))] if fmt is CHAT else []
    events = first + _events(counted, _outputs(["a", "b", "c"]))
    usages = [e["usage"] for e in events]
    assert [u["completion_tokens"] for u in usages] == ([0] if fmt is CHAT else []) + [1, 2, 3]
    assert all(u["prompt_tokens"] == 4 and u["total_tokens"] == 4 + u["completion_tokens"] for u in usages)
    assert not any("usage" in e for e in _events(ChunkWriter(fmt, "r", "m"), _outputs(["a", "b"])))


HERMES_ANSWER = ["<think>The user wants", " weather.</think>Checking. <tool", '_call>{"name": "get_weather", ',
                 '"arguments": {"city": "Paris"}}</tool_call>']  # fmt: skip


def test_a_chat_answer_with_reasoning_and_calls_is_read_alike_whole_and_streamed():
    from app.tool_calls import REASONING_PARSERS, AnswerShape, HermesParser

    shape = AnswerShape(REASONING_PARSERS["qwen3"], HermesParser())
    body = full_response_choices(CHAT, "r", "m", [_outputs(HERMES_ANSWER)], None, shape)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user wants weather.", "Checking.")
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    events = _events(ChunkWriter(CHAT, "r", "m", None, 0, shape), _outputs(HERMES_ANSWER))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_a_named_call_streams_its_arguments_as_they_come_and_a_cut_one_says_length():
    from app.tool_calls import AnswerShape

    shape = AnswerShape(forced=True, named="get_time")
    pieces = ['{"tz": ', '"CET"}']
    events = _events(ChunkWriter(CHAT, "r", "m", None, 0, shape), _outputs(pieces))
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", ())]
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""} and "id" not in calls[1]
    assert [c["function"]["arguments"] for c in calls[1:]] == pieces
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut = full_response_choices(CHAT, "r", "m", [_outputs(['{"tz": "C'], FinishReason.LENGTH)], None, shape)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"tz": "C'


def test_required_calls_come_whole_and_text_that_does_not_parse_stays_content():
    from app.tool_calls import AnswerShape, HermesParser

    shape = AnswerShape(forced=True)
    text = ['[{"name": "get_time", "parameters": {"tz": "CET"}}, ', '{"name": "get_weather", "parameters": {}}]']
    body = full_response_choices(CHAT, "r", "m", [_outputs(text)], None, shape)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", '{"tz": "CET"}'),
        ("get_weather", "{}"),
    ]
    broken = ["<tool_call>{not json}</tool_call>"]
    body = full_response_choices(CHAT, "r", "m", [_outputs(broken)], None, AnswerShape(parser=HermesParser()))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": broken[0]}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_echo_puts_each_prompt_before_its_choices_first_output(outputs, text_of):
    ids, entries, (first, held, last) = outputs
    scored = TokenLogprobs(ids[1], -2.0, ((ids[1], -2.0),))
    head = dataclasses.replace(first, prompt_logprobs=(scored,))
    echo = Echo(["Paris is", "Rome"], [ids[0], 9], per_prompt=2, num_top=1)
    choices = [[echo(i, o) for o in (head, held, last)] for i in range(3)]  # choices 0, 1: prompt 0; 2: prompt 1
    body = full_response_choices(COMPLETION, "r", "m", choices, text_of, per_prompt=2)
    assert [c["text"] for c in body["choices"]] == ["Paris is" + text_of(ids[0]) + text_of(ids[1])] * 2 + [
        "Rome" + text_of(ids[0]) + text_of(ids[1])
    ]
    logprobs = body["choices"][2]["logprobs"]
    assert logprobs["token_logprobs"] == [None, -2.0, -0.5, -1.0] and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][:2] == [text_of(9), text_of(ids[1])]
    ended = dataclasses.replace(head, finished=True, finish_reason=FinishReason.STOP)  # the one token was EOS
    alone = Echo(["Paris is"], [ids[0]], per_prompt=1, prompt_only=True, num_top=0)(0, ended)
    assert (alone.text, alone.token_ids, alone.num_output_tokens) == ("Paris is", (), 0)
    assert alone.finish_reason is FinishReason.LENGTH and [e.logprob for e in alone.logprobs] == [None, -2.0]
    aborted = dataclasses.replace(head, finished=True, finish_reason=FinishReason.ABORT)
    assert Echo(["Paris is"], [ids[0]], 1, prompt_only=True)(0, aborted).finish_reason is FinishReason.ABORT
    assert Echo(["Paris is"], [ids[0]], 1)(0, head).logprobs == first.logprobs  # scored for prompt_logprobs alone


def test_each_choice_has_its_own_prompts_logprobs_and_an_echo_keeps_its_own_alternatives(outputs, text_of):
    ids, _, (first, held, last) = outputs
    ruled_out = float("-inf")  # a token the model rules out: vLLM's -9999.0, JSON has no infinity
    scored = {
        "a": (TokenLogprobs(ids[1], -2.0, ((7, -0.5), (8, -1.0), (ids[1], -2.0)), rank=3),),
        "b": (TokenLogprobs(9, ruled_out, ((7, -0.1),), rank=49152), TokenLogprobs(5, -0.2, ((5, -0.2),), rank=1)),
    }
    choices = [[dataclasses.replace(first, prompt_logprobs=scored[p]), held, last] for p in "aab"]
    body = full_response_choices(
        COMPLETION, "r", "m", choices, text_of, per_prompt=2, scored=PromptLogprobs(1, text_of)
    )
    listed = [c["prompt_logprobs"] for c in body["choices"]]
    assert listed[0] == listed[1] and len(listed[0]) == 2 and len(listed[2]) == 3
    assert listed[2][1] == {
        "9": {"logprob": -9999.0, "rank": 49152, "decoded_token": text_of(9)},
        "7": {"logprob": -0.1, "rank": 1, "decoded_token": text_of(7)},
    }
    json.dumps(body, allow_nan=False)  # as the response is sent
    echo = Echo(["Paris is"], [ids[0]], per_prompt=1, num_top=1)  # logprobs 1 beside prompt_logprobs 3
    head = echo(0, choices[0][0]).logprobs[:2]
    assert head[1] == TokenLogprobs(ids[1], -2.0, ((7, -0.5),)) and head[0].logprob is None


def test_vllms_prompt_logprobs_rank_the_prompts_token_and_its_alternatives(outputs, text_of):
    ids, _, (first, held, last) = outputs
    # the second prompt token: the third most likely; then one the first most likely
    scored = (
        TokenLogprobs(ids[1], -2.0, ((7, -0.5), (8, -1.0), (ids[1], -2.0)), rank=3),
        TokenLogprobs(9, -0.1, ((9, -0.1), (7, -3.0)), rank=1),
    )
    choice = [dataclasses.replace(first, prompt_logprobs=scored), held, last]
    listed = PromptLogprobs(2, text_of)
    body = full_response_choices(COMPLETION, "r", "m", [choice, choice], None, per_prompt=2, scored=listed)
    second = {
        str(ids[1]): {"logprob": -2.0, "rank": 3, "decoded_token": text_of(ids[1])},  # the prompt's token first
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": text_of(7)},
        "8": {"logprob": -1.0, "rank": 2, "decoded_token": text_of(8)},
    }
    third = {
        "9": {"logprob": -0.1, "rank": 1, "decoded_token": text_of(9)},
        "7": {"logprob": -3.0, "rank": 2, "decoded_token": text_of(7)},
    }
    assert [c["prompt_logprobs"] for c in body["choices"]] == [[None, second, third]] * 2
    assert list(body["choices"][0]["prompt_logprobs"][1]) == [str(ids[1]), "7", "8"]
    assert body["choices"][0]["logprobs"] is None and "prompt_logprobs" not in body
    chat = full_response_choices(CHAT, "r", "m", [choice, choice], None, scored=PromptLogprobs(0, text_of))
    assert chat["prompt_logprobs"] == [None, {str(ids[1]): second[str(ids[1])]}, {"9": third["9"]}]
    assert all("prompt_logprobs" not in c for c in chat["choices"])
