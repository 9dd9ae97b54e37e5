"""The Responses API's request read as the chat completion it asks for (real tokenizer), and its
refusals named in the client's terms."""

from __future__ import annotations

import pytest

from app.openai_protocol import ChatCompletionRequest, ChatSetup, unsupported
from app.responses_protocol import ResponsesRequest
from engine.loader import ModelSpec, load_tokenizer
from engine.params import ContextLimits, FieldError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city.", "parameters": WEATHER}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSpec())


@pytest.fixture(scope="module")
def limits(tokenizer):
    return ContextLimits(max_model_len=512, vocab_size=len(tokenizer))


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def _error(tokenizer, limits, **fields) -> FieldError:
    with pytest.raises(FieldError) as info:
        _request(**fields).to_generation_requests(tokenizer, limits, "resp-1", ChatSetup())
    return info.value


def test_text_input_with_instructions_is_the_chat_of_a_system_and_a_user_message(tokenizer, limits):
    body = _request(input="Hi there", instructions="Be brief.", max_output_tokens=7, temperature=0)
    (request,) = body.to_generation_requests(tokenizer, limits, "resp-1", ChatSetup())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    assert request.prompt_token_ids == chat.to_generation_request(tokenizer, limits, "c", ChatSetup()).prompt_token_ids
    assert (request.sampling.max_tokens, request.sampling.temperature) == (7, 0)


def test_a_tool_loops_items_are_the_chats_messages_and_earlier_reasoning_is_left_out():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in ("Weather in ", "Paris?")]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sunny, and rain.", "annotations": []}]},
    ]  # fmt: skip
    chat = _request(input=items, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}).chat_request()
    assert [(m.role, m.for_template()["content"]) for m in chat.messages] == [
        ("user", "Weather in \nParis?"),  # text parts joined as a chat's
        ("assistant", ""),
        ("tool", "sunny"),
        ("tool", "rain"),
        ("assistant", "Sunny, and rain."),
    ]
    assert [(c.id, c.function.arguments) for c in chat.messages[1].tool_calls] == [
        ("c1", '{"city": "Paris"}'),
        ("c2", '{"city": "Lyon"}'),
    ]  # one turn's calls, one message
    assert chat.tools[0].function.parameters == WEATHER and chat.tool_choice.function.name == "get_weather"


def test_text_format_is_the_chats_response_format():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    chat = _request(input="A person as JSON.", text=fmt).chat_request()
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.json_schema == schema
    assert _request(input="x", text={"format": {"type": "json_object"}}).chat_request().response_format.type == (
        "json_object"
    )


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0", "'input_image' items are not supported"),
        ({"input": [{"role": "user"}]}, "input.0.content", "Field required"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type", "input_text"),
        ({"input": [{"type": "function_call_output", "call_id": "zz", "output": "x"}]}, "input.0.call_id", "zz"),
        ({"input": [{"type": "reasoning"}]}, "input", "no message to answer"),
        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens > max_model_len 512"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": "x", "use_beam_search": True}, "use_beam_search", "not supported"),
        ({"input": "x", "top_k": -5}, "top_k", "top_k"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "foo"}}}},
         "text.format", "Invalid type"),
        ({"input": "x", "instructions": "y" * 3000}, "input", "max_model_len"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": '}]},
         "input.0.arguments", "JSON text of an object"),
        ({"input": "x", "tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools.0.parameters", "type object"),
    ],
)  # fmt: skip
def test_refusals_name_the_clients_field(tokenizer, limits, fields, param, text):
    error = _error(tokenizer, limits, **fields)
    assert error.param == param and text in str(error) and str(error).startswith(param), str(error)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"echo": True}, "echo"),
        ({"n": 2}, "n"),
    ],
)
def test_what_needs_a_stored_response_or_is_not_done_is_refused_by_name(fields, param):
    assert unsupported(_request(input="x", **fields))[0] == param
    neutral = {"previous_response_id": None, "background": False, "include": [], "truncation": "disabled"}
    assert unsupported(_request(input="x", store=True, **neutral)) is None
    # what a response repeats back, and what openai-agents sends without a store
    sent_back = {"reasoning": {"effort": None, "summary": None}, "include": ["reasoning.encrypted_content"]}
    assert unsupported(_request(input="x", **sent_back)) is None


def test_non_function_tools_empty_input_and_a_schema_format_without_its_schema_fail_the_schema():
    from pydantic import ValidationError

    no_schema = {"format": {"type": "json_schema", "name": "a"}}
    for fields, loc in [
        ({"input": "x", "tools": [{"type": "web_search"}]}, ("tools", 0, "type")),
        ({"input": []}, ("input",)),
        ({"input": "x", "text": no_schema}, ("text", "format")),
    ]:
        with pytest.raises(ValidationError) as info:
            _request(**fields)
        assert info.value.errors()[0]["loc"][: len(loc)] == loc


def test_text_parts_and_a_typeless_item_read_as_a_chats(tokenizer, limits):
    parts = [{"type": "input_text", "text": "Weather in"}, {"type": "input_text", "text": "Paris?"}]
    (request,) = _request(input=[{"type": None, "role": "user", "content": parts}]).to_generation_requests(
        tokenizer, limits, "r", ChatSetup()
    )
    chat_parts = [{"type": "text", "text": p["text"]} for p in parts]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": chat_parts}]})
    assert request.prompt_token_ids == chat.to_generation_request(tokenizer, limits, "c", ChatSetup()).prompt_token_ids
