"""Penalties, ``logit_bias``, ``stop``, ``user`` and ``response_format`` at the edge: what
reaches the engine's ``SamplingParams``, and the field each refusal names."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.openai_protocol import ChatCompletionRequest, CompletionRequest, unsupported, validation_error_body
from engine.loader import ModelSpec, load_tokenizer
from engine.params import ContextLimits, FieldError
from engine.structured import JSON_OBJECT_SCHEMA

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSpec())


@pytest.fixture(scope="module")
def limits(tokenizer) -> ContextLimits:
    return ContextLimits(max_model_len=2048, vocab_size=len(tokenizer))


def _sampling(schema: type, body: dict, tokenizer, limits):
    request = schema.model_validate(body)
    assert unsupported(request) is None
    return request.to_generation_request(tokenizer, limits).sampling


def _field_error(schema: type, body: dict, tokenizer, limits) -> FieldError:
    with pytest.raises(FieldError) as info:
        schema.model_validate(body).to_generation_request(tokenizer, limits)
    return info.value


def test_the_fields_reach_the_engine(tokenizer, limits):
    body = {
        **CHAT,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.3,
        "logit_bias": {"50": 100, "7": -100},
        "stop": ["a", "b", "c", "d"],
        "user": "u-1",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
    }
    sp = _sampling(ChatCompletionRequest, body, tokenizer, limits)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1, 1.3)
    assert sp.logit_bias == ((7, -100.0), (50, 100.0)) and sp.stop == ("a", "b", "c", "d")
    assert json.loads(sp.json_schema) == SCHEMA and sp.json_schema.index('"b"') < sp.json_schema.index('"a"')
    completion = {**COMPLETION, "response_format": {"type": "json_object"}, "logit_bias": {"3": 1}}
    sp = _sampling(CompletionRequest, completion, tokenizer, limits)
    assert sp.json_schema == JSON_OBJECT_SCHEMA and sp.logit_bias == ((3, 1.0),)

    def schema_of(response_format):
        return _sampling(ChatCompletionRequest, {**CHAT, "response_format": response_format}, tokenizer, limits)

    assert schema_of({"type": "text"}).json_schema is None and schema_of(None).json_schema is None
    no_schema = {"type": "json_schema", "json_schema": {"name": "anything"}}
    assert schema_of(no_schema).json_schema == JSON_OBJECT_SCHEMA


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"stop": ["1", "2", "3", "4", "5"]}, "stop", "at most 4 strings"),
        ({"logit_bias": {"49152": 5}}, "logit_bias", "token id 49152 is out of vocabulary"),
        ({"logit_bias": {"dog": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "cannot be used"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
         "response_format", "cannot be used"),
    ],
)  # fmt: skip
def test_refusals_at_conversion_name_the_field(tokenizer, limits, extra, param, text):
    error = _field_error(ChatCompletionRequest, {**CHAT, **extra}, tokenizer, limits)
    assert error.param == param and text in error.message, error.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": "high"}}, "logit_bias.5"),
        ({"response_format": {"type": "regex"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_refusals_by_schema_name_the_field(extra, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, **extra})
    error = validation_error_body(info.value)["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_tools_stay_refused_by_name_and_n_is_bounded():
    assert unsupported(ChatCompletionRequest.model_validate({**CHAT, "tools": [{"type": "function"}]}))[0] == "tools"
    assert unsupported(ChatCompletionRequest.model_validate({**CHAT, "tool_choice": "required"}))[0] == "tool_choice"
    assert unsupported(ChatCompletionRequest.model_validate({**CHAT, "n": 2})) is None
    for bad in (0, 17):
        with pytest.raises(ValidationError, match="n"):
            ChatCompletionRequest.model_validate({**CHAT, "n": bad})
