"""The tool-call and reasoning parsers on strings in each model family's own format, whole and
streamed in every split (the streamed pieces reassemble to the whole answer's parse)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.tool_calls import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    Parsed,
    ReasoningStream,
    ToolCall,
    ToolCallStream,
    bound_numbers,
    forced_schema,
    parse_forced,
    parser_for_template,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
TWO = [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]
# (parser, answer, expected content, expected calls as (name, arguments))
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check.", TWO),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # EOS before the tag
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", "The sky is blue.", "The sky is blue.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"tz": "CET"}}', None, TWO),
    ("llama3_json", 'Use {"name": "x"} here', 'Use {"name": "x"} here', []),  # not at the start: content
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city":',
     []),  # cut
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]', None, TWO),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure.",
     [("get_weather", WEATHER)]),
    ("mistral", "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]', None, TWO),
    ("pythonic", "<|python_start|>[search(query='tandem', limit=3, exact=true, tags=['a', None])]<|python_end|>", None,
     [("search", {"query": "tandem", "limit": 3, "exact": True, "tags": ["a", None]})]),
    ("pythonic", "[__import__('os').system('ls')]", "[__import__('os').system('ls')]", []),  # never evaluated
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
]  # fmt: skip


def _calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_each_parser_reads_its_format_and_leaves_the_rest_as_content(name, text, content, calls) -> None:
    parsed = TOOL_PARSERS[name]().parse(text)
    assert parsed.content == content
    assert _calls(parsed) == calls
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)


def _streamed(name: str, pieces: list[str]) -> Parsed:
    stream, content, calls = ToolCallStream(TOOL_PARSERS[name]()), [], {}
    deltas = [d for piece in pieces for d in stream.feed(piece)] + list(stream.finish())
    for delta in deltas:
        if delta.kind == "content":
            content.append(delta.text)
        elif delta.first:
            assert delta.index == len(calls)  # first deltas come in order, one per call
            calls[delta.index] = [delta.call.name, ""]
        else:
            calls[delta.index][1] += delta.call.arguments
    return Parsed("".join(content) or None, tuple(ToolCall(n, a) for n, a in calls.values()))


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_streamed_in_any_split_the_deltas_reassemble_to_the_whole_parse(case, cuts) -> None:
    name, text, content, calls = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    streamed = _streamed(name, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert streamed.content == content
    assert _calls(streamed) == calls


def test_content_before_a_hermes_call_streams_before_the_call_ends() -> None:
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    first = list(stream.feed("Checking the weather <tool"))
    assert [(d.kind, d.text) for d in first] == [("content", "Checking the weather")]
    assert list(stream.feed('_call>{"name": "f", "arguments": {}}')) == []
    closed = list(stream.feed("</tool_call>"))
    assert [(d.kind, d.first, d.call.name) for d in closed] == [("call", True, "f"), ("call", False, "f")]


REASONING = [
    ("deepseek_r1", "<think>\nTwo and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    ("deepseek_r1", "Two and two.</think>Four.", "Two and two.", "Four."),  # the template opened the tag
    ("deepseek_r1", "Still thinking", "Still thinking", None),  # cut before the tag closed
    ("qwen3", "<think>Hmm.</think>\nFour.", "Hmm.", "Four."),
    ("qwen3", "Four.", None, "Four."),  # thinking off
    ("qwen3", "<think></think>Four.", None, "Four."),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING)
def test_reasoning_parsers_split_think_tags(name, text, reasoning, content) -> None:
    assert REASONING_PARSERS[name].split(text) == (reasoning, content)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(REASONING), cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=6))
def test_reasoning_streamed_in_any_split_reassembles(case, cuts) -> None:
    name, text, reasoning, content = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream, got = ReasoningStream(REASONING_PARSERS[name]), {"reasoning": "", "content": ""}
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    for i, piece in enumerate(pieces):
        for delta in stream.feed(piece, final=i == len(pieces) - 1):
            got[delta.kind] += delta.text
    assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content)


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
    bounded = bound_numbers(schema)["properties"]
    assert (bounded["n"]["minimum"], bounded["n"]["maximum"]) == (-(2**53 - 1), 2**53 - 1)
    assert (bounded["m"]["minimum"], bounded["m"]["maximum"]) == (0, 2**53 - 1) and "multipleOf" not in bounded["m"]
    assert bounded["x"]["multipleOf"] == 0.5 and bounded["y"]["multipleOf"] == 1e-9
    assert bounded["s"] == schema["properties"]["s"]  # data, not a schema


def test_a_bounded_number_cannot_run_on(tokenizer_matcher) -> None:
    """Under llguidance the bounds and the multipleOf leave no room for a 17th integer digit, a
    10th decimal or an exponent; the numbers a double holds still pass."""
    schema = bound_numbers({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    for text, accepted in (('{"x": 0.123456789}', True), ('{"x": 0.1234567891}', False), ('{"x": -2.5}', True),
                           ('{"x": 12345678901234567}', False), ('{"x": 1e300}', False)):  # fmt: skip
        assert tokenizer_matcher(schema, text) == accepted, text


def test_the_parser_a_template_implies() -> None:
    assert parser_for_template("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("[TOOL_CALLS]") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


def test_api_settings_name_what_they_refuse(tmp_path) -> None:
    from pydantic import ValidationError

    from app.settings import AppConfig

    for bad, field in (
        ({"api.tool_call_parser": "nope"}, "tool_call_parser"),
        ({"api.reasoning_parser": "x"}, "reasoning"),
    ):
        with pytest.raises(ValidationError, match=f"api.{field}"):
            AppConfig.load(bad)
    with pytest.raises(ValidationError, match="neither a file nor a Jinja template"):
        AppConfig.load({"api.chat_template": str(tmp_path / "missing.jinja")})
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert AppConfig.load({"api.chat_template": str(template)}).api.template_text == template.read_text()


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
