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


ADVERSARIAL = [
    "<tool_call>" + "[" * 5000,  # deeper than Python's JSON reader goes
    '<tool_call>{"name": "f", "arguments": {"x": "\\ud800", "n": NaN, "big": 1e999}}</tool_call>',
    "[f(a={[1]: 2})]",
    "[f(a={(1, 2): 2})]",
    "[f(a={1, 2})]",
    "[f(a=b'x')]",
    "[f(a=1j)]",
    "[f(a=...)]",
    "[f(**kw)]",
    "[f(a=" + "-" * 100_000 + "1)]",
    "[" * 5000 + "]" * 5000,
    '[TOOL_CALLS][{"name": "f", "arguments": {}}] [{"x": 1}]',  # a trailing value is not dropped
    '{"name": "Bob", "age": 3}',  # no parameters: an object, not a call
]


@pytest.mark.parametrize("text", ADVERSARIAL)
@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_model_text_that_defeats_a_parser_comes_back_as_content(name, text) -> None:
    parsed = TOOL_PARSERS[name]().parse(text)
    for call in parsed.calls:  # whatever is read as a call has arguments every JSON reader takes
        assert json.loads(call.arguments, parse_constant=lambda c: pytest.fail(c)) is not None
        call.arguments.encode("ascii")
    if not parsed.calls:
        assert parsed.content == text.strip()
    assert _streamed(name, [text[: len(text) // 2], text[len(text) // 2 :]]).content == parsed.content


def test_a_call_of_a_function_the_request_did_not_declare_stays_content() -> None:
    known = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    parsed = TOOL_PARSERS["hermes"](["get_time"]).parse(known + unknown)
    assert [c.name for c in parsed.calls] == ["get_time"] and parsed.content == unknown
    assert TOOL_PARSERS["pythonic"](["get_time"]).parse("[rm_rf()]").calls == ()
    assert TOOL_PARSERS["mistral"](["get_time"]).parse('[TOOL_CALLS]rm_rf{"a": 1}').calls == ()


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


FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
]
LAZY = [  # (parser, text, accepted whole, may end there)
    ("hermes", "It is sunny in Paris, as <b>usual</b>.", True, True),
    ("hermes", 'Checking.<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', True, True),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> Done.', True, True),
    ("hermes", '<tool_call>\n{"name": "get_date"', False, False),  # not a declared function
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"town": ', False, False),  # not its parameter
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}', True, False),  # mid-call
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', True, True),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 3', False, False),
]


@pytest.mark.parametrize(("name", "text", "accepted", "may_end"), LAZY)
def test_a_lazy_grammar_lets_text_pass_and_forces_a_call_once_its_trigger_is_written(
    name, text, accepted, may_end, lark_matcher
) -> None:
    grammar = TOOL_PARSERS[name]().lazy_grammar(FUNCTIONS)
    assert lark_matcher(grammar, text) == (accepted, may_end)


def test_formats_without_a_trigger_have_no_lazy_grammar() -> None:
    assert TOOL_PARSERS["pythonic"]().lazy_grammar(FUNCTIONS) is None
    assert TOOL_PARSERS["llama3_json"]().lazy_grammar(FUNCTIONS) is None


@pytest.fixture(scope="module")
def lark_matcher():
    """(every token accepted, EOS allowed after them) for the default model's tokens of a text."""
    from engine.loader import ModelSpec, load_tokenizer
    from engine.structured import GrammarCache

    tokenizer = load_tokenizer(ModelSpec())
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepts(grammar: str, text: str) -> tuple[bool, bool]:
        matcher = cache.matcher(grammar, "lark")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        accepted = all(matcher.advance(t) for t in ids)
        return accepted, accepted and matcher.llmatcher.is_accepting()

    return accepts


def test_a_request_has_one_grammar_at_most() -> None:
    from engine.params import FieldError, SamplingParams

    lazy = TOOL_PARSERS["hermes"]().lazy_grammar(FUNCTIONS)
    assert SamplingParams(lark_grammar=lazy).grammar == (lazy, "lark")
    assert SamplingParams(json_schema='{"type":"object"}').grammar == ('{"type":"object"}', "json")
    with pytest.raises(FieldError, match="tools"):
        SamplingParams(json_schema='{"type":"object"}', lark_grammar=lazy)


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_a_constraint_under_a_reasoning_parser_holds_once_the_reasoning_ends(lark_matcher, reasoning) -> None:
    """vLLM's structured outputs with a reasoning parser: any reasoning, then the answer under
    the schema or the guided choice. Qwen3's model opens its reasoning (or answers at once);
    DeepSeek-R1's template opened it, so it comes first."""
    from app.openai_protocol import ChatCompletionRequest, ChatSetup
    from engine.loader import ModelSpec, load_tokenizer
    from engine.params import ContextLimits

    tokenizer = load_tokenizer(ModelSpec())
    chat = ChatSetup.of(tokenizer.chat_template, None, None, reasoning)
    limits = ContextLimits(max_model_len=2048, vocab_size=len(tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    asks = {
        "json": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
        "choice": {"guided_choice": ["yes", "no"]},
    }
    opened = "<think>" if reasoning == "qwen3" else ""
    for name, ask in asks.items():
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **ask}
        sampling = (
            ChatCompletionRequest.model_validate(body).to_generation_request(tokenizer, limits, chat=chat).sampling
        )
        answer = '{"a": 1}' if name == "json" else "no"
        assert sampling.json_schema is None, name
        assert lark_matcher(sampling.lark_grammar, f"{opened}Say {answer}.</think>\n\n{answer}") == (True, True), name
        assert lark_matcher(sampling.lark_grammar, f"{opened}Hm.</think>\n\nSure: {answer}")[0] is False, name
        at_once = lark_matcher(sampling.lark_grammar, answer)
        assert at_once == ((True, True) if reasoning == "qwen3" else (True, False)), (
            name
        )  # DeepSeek-R1: still reasoning
    plain = ChatSetup.of(tokenizer.chat_template, None, None, None)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **asks["json"]}
    assert (
        ChatCompletionRequest.model_validate(body)
        .to_generation_request(tokenizer, limits, chat=plain)
        .sampling.json_schema
    )


def test_a_grammar_the_engine_cannot_compile_names_the_client_s_field() -> None:
    """A guided grammar that names a token this tokenizer lacks passes the ingress's check and
    fails where it meets the vocabulary: the 400 names the client's field, not ``tools``."""
    from app.openai_protocol import CompletionRequest
    from engine.loader import ModelSpec, load_tokenizer
    from engine.params import ContextLimits, FieldError
    from engine.structured import GrammarCache

    tokenizer = load_tokenizer(ModelSpec())
    body = {"model": "m", "prompt": "Hi", "guided_grammar": "start: <|no_such_token|>"}
    limits = ContextLimits(max_model_len=2048, vocab_size=len(tokenizer))
    sampling = CompletionRequest.model_validate(body).to_generation_request(tokenizer, limits).sampling
    assert sampling.grammar_field == "guided_grammar"
    with pytest.raises(FieldError) as info:
        GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).matcher(
            *sampling.grammar, field=sampling.grammar_field
        )
    assert info.value.param == "guided_grammar" and "no_such_token" in info.value.message
