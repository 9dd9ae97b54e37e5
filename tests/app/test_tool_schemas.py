"""The JSON Schemas output is generated under: numbers and untyped values bounded, forced calls
closed to undeclared keys with their definitions lifted; checked against llguidance itself."""

from __future__ import annotations

import json

import pytest

from app.tool_calls import Parsed, parse_forced
from app.tool_schemas import bounded, forced_schema


def _calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_forced_schemas_and_their_answers() -> None:
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
                 {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]  # fmt: skip
    required = forced_schema(functions, None, parallel=False)
    assert required["maxItems"] == 1 and [i["properties"]["name"]["const"] for i in required["items"]["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    assert "maxItems" not in forced_schema(functions, None, parallel=True)
    # the named function's parameters, closed to keys it does not declare
    assert forced_schema(functions, "get_time", parallel=False) == {
        **functions[1]["parameters"],
        "additionalProperties": False,
    }
    assert required["items"]["anyOf"][0]["properties"]["parameters"]["additionalProperties"] is False
    parsed = parse_forced('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', None)
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})] and parsed.content is None
    assert _calls(parse_forced('{"city": "Paris"}', "get_weather")) == [("get_weather", {"city": "Paris"})]


def test_unbounded_numbers_are_bounded_to_what_json_consumers_hold() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"],
              "minimum": 0}, "x": {"type": "number", "multipleOf": 0.5}, "y": {"type": "number"},
              "s": {"type": "string", "enum": [{"type": "integer"}]}}}  # fmt: skip
    out = bounded(schema)["properties"]
    assert (out["n"]["minimum"], out["n"]["maximum"]) == (-(2**53 - 1), 2**53 - 1)
    assert (out["m"]["minimum"], out["m"]["maximum"]) == (0, 2**53 - 1) and "multipleOf" not in out["m"]
    assert out["x"]["multipleOf"] == 0.5 and out["y"]["multipleOf"] == 1e-9
    assert out["s"] == schema["properties"]["s"]  # data, not a schema


def test_a_bounded_number_cannot_run_on(tokenizer_matcher) -> None:
    """Under llguidance the bounds and the multipleOf leave no room for a 17th integer digit, a
    10th decimal or an exponent; the numbers a double holds still pass."""
    schema = bounded({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    for text, accepted in (('{"x": 0.123456789}', True), ('{"x": 0.1234567891}', False), ('{"x": -2.5}', True),
                           ('{"x": 12345678901234567}', False), ('{"x": 1e300}', False)):  # fmt: skip
        assert tokenizer_matcher(schema, text) == accepted, text


@pytest.mark.parametrize(
    "schema",
    [{"type": "object"}, {"type": "object", "properties": {"a": {}}, "required": ["a"]}, {}],
    ids=["json_object", "untyped-property", "empty"],
)
def test_values_a_schema_leaves_untyped_are_json_with_bounded_numbers(schema, tokenizer_matcher) -> None:
    out = bounded(schema)
    assert tokenizer_matcher(out, '{"a": [1, -2.5, "x", {"b": null}, true]}')
    assert not tokenizer_matcher(out, '{"a": ' + "1" * 40 + "}")
    assert not tokenizer_matcher(out, '{"a": [0.1234567891]}')


def test_a_property_named_like_a_keyword_is_a_name_not_a_schema() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "string"}, "items": {"type": "integer"}}}
    closed = forced_schema([{"name": "f", "parameters": schema}], "f", False)
    assert set(closed["properties"]) == {"properties", "items"} and closed["additionalProperties"] is False
    assert closed["properties"]["items"]["maximum"] == 2**53 - 1


def test_a_required_call_keeps_its_definitions_reachable(tokenizer_matcher) -> None:
    """openai-agents and LangChain send pydantic schemas: nested models as $defs and $ref."""
    place = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
             "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"]}  # fmt: skip
    functions = [{"name": "where", "parameters": place}, {"name": "when", "parameters": place}]
    schema = forced_schema(functions, None, parallel=True)
    assert set(schema["$defs"]) >= {"f0_Loc", "f1_Loc"}
    call = '[{"name": "when", "parameters": {"loc": {"city": "Oslo"}}}]'
    assert tokenizer_matcher(schema, call) and not tokenizer_matcher(schema, call.replace("city", "town"))


@pytest.fixture(scope="module")
def tokenizer_matcher():
    """Whether the default model's tokens of a text complete a schema's grammar in the engine's matcher."""
    from engine.loader import ModelSpec, load_tokenizer
    from engine.structured import GrammarCache, check_schema

    tokenizer = load_tokenizer(ModelSpec())
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepts(schema: dict, text: str) -> bool:
        matcher = cache.matcher(check_schema(schema))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return all(matcher.advance(t) for t in ids) and matcher.done

    return accepts
