"""Structured outputs: a JSON schema as a token mask in the engine's sampling step."""

from __future__ import annotations

import json

import pytest

from engine.params import FieldError, FinishReason, GenerationRequest, Role, SamplingParams
from engine.structured import JSON_OBJECT_SCHEMA, check_schema
from tests.engine.conftest import run_to_completion
from tests.engine.test_roles import _handover

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 20},
        "likes_cats": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "likes_cats"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person with their name, age and city as JSON."}]


def _validate(document: object, schema: dict) -> None:
    """Against the schema with ``jsonschema`` when installed, else its required keys and types."""
    try:
        import jsonschema
    except ImportError:
        types = {"string": str, "integer": int, "boolean": bool, "object": dict}
        assert isinstance(document, dict) and set(document) == set(schema["required"])
        for key, prop in schema["properties"].items():
            assert isinstance(document[key], types[prop["type"]]), (key, document[key])
        return
    jsonschema.validate(document, schema)


def _text(outputs) -> str:
    return "".join(o.text for o in outputs)


def _greedy(max_tokens: int = 60, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_a_json_schema_forces_valid_json_where_the_model_would_not_write_it(smol, make_engine):
    core = make_engine(smol)
    free = core.make_request(ASK, _greedy(), request_id="free")
    forced = core.make_request(ASK, _greedy(json_schema=check_schema(PERSON)), request_id="forced")
    outputs = run_to_completion(core, {0: [free, forced]})
    with pytest.raises(json.JSONDecodeError):  # the model wraps its JSON in a markdown fence
        json.loads(_text(outputs["free"]))
    assert _text(outputs["free"]).startswith("```")
    document = json.loads(_text(outputs["forced"]))
    _validate(document, PERSON)
    assert list(document) == ["name", "age", "city", "likes_cats"]  # the schema's order
    final = outputs["forced"][-1]
    # it ends when the grammar is complete, at the closing brace, without waiting for EOS
    assert final.finish_reason is FinishReason.STOP and final.text.endswith("}")
    assert final.num_output_tokens < 60


def test_json_object_mode_and_a_plain_neighbour_in_the_same_batch(smol, make_engine):
    """The plain row gets the tokens it gets alone; one compile serves the same schema twice."""
    core = make_engine(smol)
    alone = run_to_completion(core, {0: [core.make_request(ASK, _greedy(24), request_id="alone")]})["alone"]
    plain = core.make_request(ASK, _greedy(24), request_id="plain")
    objects = [core.make_request(ASK, _greedy(json_schema=JSON_OBJECT_SCHEMA), request_id=f"obj-{i}") for i in (0, 1)]
    outputs = run_to_completion(core, {0: [plain, *objects]})
    assert [t for o in outputs["plain"] for t in o.token_ids] == [t for o in alone for t in o.token_ids]
    for i in (0, 1):
        assert isinstance(json.loads(_text(outputs[f"obj-{i}"])), dict)
    assert core.grammars.num_compiled == 1


def test_sampled_requests_follow_the_schema_too(smol, make_engine):
    core = make_engine(smol)
    schema = check_schema(PERSON)
    requests = [
        core.make_request(ASK, SamplingParams(max_tokens=80, temperature=1.0, seed=s, json_schema=schema))
        for s in range(3)
    ]
    outputs = run_to_completion(core, {0: requests})
    documents = [json.loads(_text(outputs[r.request_id])) for r in requests]
    for document in documents:
        _validate(document, PERSON)
    assert len({json.dumps(d) for d in documents}) > 1  # sampled, not forced to one answer


def test_unusable_schemas_are_refused_naming_response_format(smol, make_engine):
    core = make_engine(smol, max_model_len=128, num_blocks=16)
    for schema in ({"type": "foo"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, [1]):
        with pytest.raises(FieldError, match="^response_format: ") as info:
            check_schema(schema)
        assert info.value.param == "response_format"
    bad = GenerationRequest("bad", (1, 2, 3), SamplingParams(json_schema='{"type": "string", "pattern": "(("}'))
    with pytest.raises(FieldError, match="^response_format: the JSON schema cannot be used") as info:
        core.add_request(bad)
    assert info.value.param == "response_format"
    assert core.stats().num_free_blocks == 16 and not core.has_work()
    assert check_schema({"b": 1, "a": 2}) == '{"b":1,"a":2}'  # key order kept: properties are written in it


def test_the_grammar_state_holds_across_the_prefill_decode_handover(smol, make_engine):
    """The prefill replica samples ``{`` under the grammar; the decode replica rebuilds the
    matcher from the request and advances it by that first token: the same JSON as one engine."""
    sp = SamplingParams(max_tokens=60, temperature=0, logprobs=1, json_schema=check_schema(PERSON))
    both = make_engine(smol)
    request = both.make_request(ASK, sp, request_id="pd-json")
    whole = run_to_completion(both, {0: [request]})[request.request_id]
    prefill_core, decode_core = make_engine(smol, role=Role.PREFILL), make_engine(smol, role=Role.DECODE)
    result, outputs = _handover(prefill_core, decode_core, request)
    assert result.first_text.startswith("{")  # the matcher must be past it on the decode side
    assert _text(outputs) == _text(whole)
    _validate(json.loads(_text(outputs)), PERSON)
    assert outputs[-1].finish_reason is FinishReason.STOP


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}}, "required": ["city"]}}},
]  # fmt: skip
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]


def test_a_forced_tool_call_on_a_lent_replica_and_across_the_hand_off(smol, make_engine):
    """A forced call's JSON Schema, built at the edge: a prefill engine lent to decode (flipped to
    ``both``) serves the request whole, a prefill -> decode hand-off gives the same tokens, and the
    call parses and validates."""
    import jsonschema

    from app.openai_protocol import ChatCompletionRequest, ChatSetup
    from engine.params import ContextLimits

    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": TOOL_ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 40,
            "temperature": 0,
            "parallel_tool_calls": False,
            "logprobs": True,
            "top_logprobs": 1,
        }
    )
    chat = ChatSetup.of(smol.tokenizer.chat_template, None, None, None)
    request = body.to_generation_request(smol.tokenizer, ContextLimits(2048, len(smol.tokenizer)), "lent", chat)
    assert request.sampling.grammar is not None
    lent = make_engine(smol, role=Role.PREFILL)
    lent.set_role(Role.BOTH)
    whole = run_to_completion(lent, {0: [request]})[request.request_id]
    prefill_core, decode_core = make_engine(smol, role=Role.PREFILL), make_engine(smol, role=Role.DECODE)
    _, outputs = _handover(prefill_core, decode_core, request)
    assert _text(outputs) == _text(whole)
    [call] = body.answer_shape(chat).read(_text(whole))[1].calls
    assert call.name == "get_weather" and outputs[-1].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
