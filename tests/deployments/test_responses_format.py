"""Engine outputs -> Responses API bodies and events (pure functions): the same items streamed or
not, in OpenAI's event order."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.responses_protocol import ResponsesRequest
from app.tool_calls import REASONING_PARSERS, AnswerShape, HermesParser
from deployments.responses_format import ResponsesFormat
from engine.params import FinishReason, RequestOutput

FORMAT = ResponsesFormat(count_tokens=lambda text: len(text.split()))
BODY = ResponsesRequest.model_validate({"model": "m", "input": "Hi", "metadata": {"k": "v"}, "max_output_tokens": 9})
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _outputs(pieces: list[str], reason: FinishReason = FinishReason.STOP) -> list[RequestOutput]:
    common = {"request_id": "r", "num_prompt_tokens": 5, "num_cached_tokens": 2}
    return [
        RequestOutput(
            **common,
            token_ids=(1,),
            text=piece,
            finished=i == len(pieces) - 1,
            finish_reason=reason if i == len(pieces) - 1 else None,
            num_output_tokens=i + 1,
        )
        for i, piece in enumerate(pieces)
    ]


def _events(outputs: list[RequestOutput], shape) -> list[dict]:
    (writer,) = FORMAT.writers(BODY, "resp-1", "m", [None], None, shape)
    raw = writer.start() + b"".join(filter(None, map(writer.delta, outputs)))
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _items(output: list[dict]) -> list[tuple]:
    """Each item without its generated ids."""
    return [tuple((k, json.dumps(v)) for k, v in item.items() if k not in ("id", "call_id")) for item in output]


@pytest.mark.parametrize(
    ("pieces", "reason", "shape", "expected"),
    [
        (["Hello", " there."], FinishReason.STOP, None, [("message", "Hello there.", "completed")]),
        (["Hello", " the"], FinishReason.LENGTH, None, [("message", "Hello the", "incomplete")]),
        ([""], FinishReason.STOP, None, [("message", "", "completed")]),
        (
            ["<think>Paris is ", "in France.</think>", "Paris."],
            FinishReason.STOP,
            AnswerShape(REASONING_PARSERS["qwen3"]),
            [("reasoning", "Paris is in France.", "completed"), ("message", "Paris.", "completed")],
        ),
        (
            ["Let me check.", CALL[:20], CALL[20:]],
            FinishReason.STOP,
            AnswerShape(parser=HermesParser()),
            [("message", "Let me check.", "completed"), ("function_call", '{"city": "Paris"}', "completed")],
        ),
        (
            ["<think>Only ", "thoughts."],
            FinishReason.LENGTH,
            AnswerShape(REASONING_PARSERS["qwen3"]),
            [("reasoning", "Only thoughts.", "completed"), ("message", "", "incomplete")],
        ),
        (
            ['{"city": ', '"Paris"}'],
            FinishReason.STOP,
            AnswerShape(forced=True, named="get_weather"),
            [("function_call", '{"city": "Paris"}', "completed")],
        ),
    ],
    ids=["text", "length", "empty", "reasoning", "call", "reasoning-only", "forced-named"],
)
def test_an_answer_is_the_same_items_streamed_or_not(pieces, reason, shape, expected):
    outputs = _outputs(pieces, reason)
    body = FORMAT.full(BODY, "resp-1", "m", [outputs], None, shape)
    found = [
        (i["type"], i["arguments"] if i["type"] == "function_call" else i["content"][0]["text"], i["status"])
        for i in body["output"]
    ]
    assert found == expected
    status = "incomplete" if reason == FinishReason.LENGTH else "completed"
    assert (body["object"], body["status"], body["model"], body["metadata"]) == ("response", status, "m", {"k": "v"})
    assert body["incomplete_details"] == ({"reason": "max_output_tokens"} if status == "incomplete" else None)
    reasoning = len(expected[0][1].split()) if expected[0][0] == "reasoning" else 0  # FORMAT counts words
    assert body["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": len(pieces),
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": 5 + len(pieces),
    }
    assert (body["max_output_tokens"], body["store"], body["tool_choice"]) == (9, False, "none")

    events = _events(outputs, shape)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    last = events[-1]
    assert last["type"] == f"response.{status}" and _items(last["response"]["output"]) == _items(body["output"])
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == last["response"]["output"]
    assert all(i["call_id"].startswith("call_") for i in done + body["output"] if i["type"] == "function_call")
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(expected)))
    assert all(e["item"]["status"] == "in_progress" for e in added)
    for index, (kind, text, _) in enumerate(expected):  # each item's deltas add up to it
        delta_type = {
            "message": "response.output_text.delta",
            "reasoning": "response.reasoning_text.delta",
            "function_call": "response.function_call_arguments.delta",
        }[kind]
        deltas = [e for e in events if e["type"] == delta_type and e["output_index"] == index]
        assert "".join(e["delta"] for e in deltas) == text
        assert all(e["item_id"] == done[index]["id"] for e in deltas)


def test_an_answer_the_engine_could_not_finish_is_a_failed_response():
    outputs = _outputs(['{"a": ', "x"], FinishReason.ERROR)
    outputs[-1] = dataclasses.replace(outputs[-1], error="response_format: the grammar refused token 7")
    body = FORMAT.full(BODY, "resp-1", "m", [outputs], None, None)
    assert (body["status"], body["incomplete_details"]) == ("failed", None)
    assert body["error"] == {"code": "server_error", "message": "response_format: the grammar refused token 7"}
    assert [(i["type"], i["status"]) for i in body["output"]] == [("message", "incomplete")]
    last = _events(outputs, None)[-1]
    assert last["type"] == "response.failed" and last["response"]["error"] == body["error"]


def test_a_failure_after_the_start_is_an_error_event():
    (writer,) = FORMAT.writers(BODY, "resp-1", "m", [None], None, None)
    writer.start()
    body = {"error": {"message": "replica lost", "type": "server_error", "param": None, "code": None}}
    event, data = writer.error(body).decode().strip().split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "sequence_number": 2,
        "code": "server_error",
        "message": "replica lost",
        "param": None,
    }
    assert writer.done() == b""
