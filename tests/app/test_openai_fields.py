"""Penalties, ``logit_bias``, ``stop``, ``user`` and ``response_format`` at the edge: what
reaches the engine's ``SamplingParams``, and the field each refusal names."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.openai_protocol import (
    ChatCompletionRequest,
    ChatSetup,
    CompletionRequest,
    unsupported,
    validation_error_body,
)
from app.tokenize_protocol import DetokenizeRequest, tokenize_schema
from engine.loader import ModelSpec, load_tokenizer
from engine.params import ContextLimits, FieldError
from engine.tokenization import encode_prompt

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSpec())


@pytest.fixture(scope="module")
def limits(tokenizer) -> ContextLimits:
    return ContextLimits(max_model_len=2048, vocab_size=len(tokenizer))


def _any_object(schema_text: str) -> bool:
    """A JSON object of any keys whose values are JSON with bounded numbers (json_object's schema)."""
    schema = json.loads(schema_text)
    value = schema["$defs"]["tandem_json_value"]["anyOf"]
    bounded = {"type": "number", "minimum": -(2**53 - 1), "maximum": 2**53 - 1, "multipleOf": 1e-9}
    return (
        schema["type"] == "object"
        and schema["additionalProperties"] == {"$ref": "#/$defs/tandem_json_value"}
        and (bounded in value)
    )


def _sampling(schema: type, body: dict, tokenizer, limits):
    request = schema.model_validate(body)
    assert unsupported(request) is None
    chat = ChatSetup.of(tokenizer.chat_template, None, None, None)
    return request.to_generation_request(tokenizer, limits, chat=chat).sampling


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
    # an integer without bounds of its own is kept to what a JSON consumer holds exactly
    bounded = {**SCHEMA["properties"]["b"], "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert json.loads(sp.json_schema) == {**SCHEMA, "properties": {**SCHEMA["properties"], "b": bounded}}
    assert sp.json_schema.index('"b"') < sp.json_schema.index('"a"')
    completion = {**COMPLETION, "response_format": {"type": "json_object"}, "logit_bias": {"3": 1}}
    sp = _sampling(CompletionRequest, completion, tokenizer, limits)
    assert _any_object(sp.json_schema) and sp.logit_bias == ((3, 1.0),)

    def schema_of(response_format):
        return _sampling(ChatCompletionRequest, {**CHAT, "response_format": response_format}, tokenizer, limits)

    assert schema_of({"type": "text"}).json_schema is None and schema_of(None).json_schema is None
    no_schema = {"type": "json_schema", "json_schema": {"name": "anything"}}
    assert _any_object(schema_of(no_schema).json_schema)


def test_vllm_s_sampling_extensions_reach_the_engine(tokenizer, limits):
    """``stop_token_ids``, ``min_p``; ``top_k`` 0 and -1 mean every token, as vLLM's (its clients send -1)."""
    assert _sampling(ChatCompletionRequest, {**CHAT, "stop_token_ids": [7, 2]}, tokenizer, limits).stop_token_ids == (
        7,
        2,
    )
    for top_k, expected in ((-1, None), (0, None), (None, None), (5, 5)):
        sp = _sampling(CompletionRequest, {**COMPLETION, "top_k": top_k, "min_p": 0.05}, tokenizer, limits)
        assert (sp.top_k, sp.min_p) == (expected, 0.05)
    for extra, param in (({"min_p": 1.5}, "min_p"), ({"top_k": -2}, "top_k")):
        error = _field_error(CompletionRequest, {**COMPLETION, **extra}, tokenizer, limits)
        assert error.param == param and "must be" in error.message, error.message


def test_vllm_s_prompt_truncation_and_kept_stop_strings(tokenizer, limits):
    """``truncate_prompt_tokens`` keeps the prompt's last k tokens (-1: the last max_model_len);
    ``include_stop_str_in_output`` reaches the engine."""
    words = {**COMPLETION, "prompt": " ".join(["word"] * 3000), "max_tokens": 1}
    ids = tokenizer(words["prompt"])["input_ids"]
    for keep, expected in ((5, ids[-5:]), (-1, ids[-2048:])):
        request = CompletionRequest.model_validate({**words, "truncate_prompt_tokens": keep, "max_tokens": None})
        if keep == -1:  # the whole context is prompt: no room for a token
            with pytest.raises(FieldError, match="max_model_len"):
                request.to_generation_request(tokenizer, limits)
            continue
        assert list(request.to_generation_request(tokenizer, limits).prompt_token_ids) == expected
    chat = ChatCompletionRequest.model_validate({**CHAT, "truncate_prompt_tokens": 3})
    whole = chat.prompt_token_ids(tokenizer)
    assert chat.to_generation_request(tokenizer, limits).prompt_token_ids == tuple(whole[-3:])
    for keep in (0, -2, 2049):
        error = _field_error(CompletionRequest, {**COMPLETION, "truncate_prompt_tokens": keep}, tokenizer, limits)
        assert error.param == "truncate_prompt_tokens" and "[1, 2048]" in error.message, error.message
    body = {**COMPLETION, "stop": ["x"], "include_stop_str_in_output": True}
    assert _sampling(CompletionRequest, body, tokenizer, limits).include_stop_str_in_output is True
    assert _sampling(CompletionRequest, COMPLETION, tokenizer, limits).include_stop_str_in_output is False


def test_vllm_s_token_constraints_reach_the_engine(tokenizer, limits):
    """``bad_words`` (tokenized here, alone and after a space), ``allowed_token_ids``, ``skip_special_tokens``."""
    body = {**CHAT, "bad_words": ["Paris"], "allowed_token_ids": [5, 38634], "skip_special_tokens": False}
    sp = _sampling(ChatCompletionRequest, body, tokenizer, limits)
    assert (sp.bad_words_token_ids, sp.allowed_token_ids, sp.skip_special_tokens) == (
        ((38634,), (7042,)),
        (5, 38634),
        False,
    )
    refused = [
        ({"bad_words": ["ok", "  "]}, "bad_words.1", "only white space"),
        ({"allowed_token_ids": [49152]}, "allowed_token_ids", "out of vocabulary"),
        ({"allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids", "left out when the output follows"),
        ({"bad_words": ["a"], "guided_choice": ["a", "b"]}, "bad_words", "left out when the output follows a grammar"),
    ]
    for extra, param, text in refused:
        error = _field_error(CompletionRequest, {**COMPLETION, **extra}, tokenizer, limits)
        assert error.param == param and text in error.message, error.message
    with pytest.raises(ValidationError) as info:  # a strict integer, as the token ids
        CompletionRequest.model_validate({**COMPLETION, "truncate_prompt_tokens": "3"})
    assert validation_error_body(info.value)["error"]["param"] == "truncate_prompt_tokens"


def test_tokenize_bodies_give_the_generation_endpoints_ids_and_detokenize_names_a_bad_id(tokenizer, limits):
    """vLLM's /tokenize (a completion's text or a chat) and /detokenize, as the ingress reads them."""
    chat = ChatSetup.of(tokenizer.chat_template, None, None, None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    forms = [
        ({"prompt": "hi there"}, CompletionRequest, {**COMPLETION, "prompt": "hi there"}),
        ({"messages": CHAT["messages"]}, ChatCompletionRequest, CHAT),
        (
            {"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
            ChatCompletionRequest,
            {**CHAT, "messages": messages, "add_generation_prompt": False, "continue_final_message": True},
        ),
    ]
    for body, schema, generation in forms:
        request = tokenize_schema(body).model_validate(body)
        expected = schema.model_validate(generation).to_generation_request(tokenizer, limits, chat=chat)
        assert tuple(request.token_ids(tokenizer, chat)) == expected.prompt_token_ids
    refused = [
        ({"messages": CHAT["messages"], "add_special_tokens": True}, "add_special_tokens", "not supported"),
        ({"messages": CHAT["messages"], "chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs", "reserved"),
        ({"messages": messages, "continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ]
    for body, param, text in refused:
        with pytest.raises(FieldError) as info:
            tokenize_schema(body).model_validate(body).token_ids(tokenizer, chat)
        assert info.value.param == param and text in info.value.message, info.value.message
    assert tokenize_schema({"prompt": ""}).model_validate({"prompt": ""}).token_ids(tokenizer, chat) == []  # vLLM's
    chat_template = {"messages": CHAT["messages"], "chat_template": "{{ messages }}"}
    with pytest.raises(FieldError, match="^chat_template: .* is not supported") as info:
        tokenize_schema(chat_template).model_validate(chat_template).token_ids(tokenizer, chat)
    ids = tokenizer("Café ☕", add_special_tokens=False)["input_ids"]
    assert DetokenizeRequest.model_validate({"tokens": ids}).text(tokenizer, limits) == "Café ☕"
    for bad in (-1, len(tokenizer)):
        with pytest.raises(FieldError) as info:
            DetokenizeRequest.model_validate({"tokens": [*ids, bad]}).text(tokenizer, limits)
        assert info.value.param == f"tokens.{len(ids)}" and "out of vocabulary" in info.value.message
    with pytest.raises(FieldError, match="^tokens: 2049 ids, more than a context holds") as info:
        DetokenizeRequest.model_validate({"tokens": [5] * 2049}).text(tokenizer, limits)
    with pytest.raises(FieldError, match="^messages: this model has no tokenizer"):  # dummy weights: not a 500
        ChatCompletionRequest.model_validate(CHAT).to_generation_request(None, limits)


def test_vllm_s_output_constraints_become_the_engine_s_grammars(tokenizer, limits):
    """guided_json (an object or its text), guided_regex and guided_choice, or the same keys of
    structured_outputs: the JSON schema or a Lark grammar, checked at the edge."""
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    for field in (
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
        {"structured_outputs": {"json": schema}},
    ):
        sp = _sampling(ChatCompletionRequest, {**CHAT, **field}, tokenizer, limits)
        assert (json.loads(sp.json_schema), sp.lark_grammar) == (schema, None)
    sp = _sampling(CompletionRequest, {**COMPLETION, "structured_outputs": {"json_object": True}}, tokenizer, limits)
    assert _any_object(sp.json_schema)
    sp = _sampling(CompletionRequest, {**COMPLETION, "guided_regex": "[0-9]+/[a-z]"}, tokenizer, limits)
    assert (sp.json_schema, sp.lark_grammar) == (None, "start: /[0-9]+\\/[a-z]/")
    sp = _sampling(CompletionRequest, {**COMPLETION, "guided_grammar": 'root ::= "yes" | [0-9]+'}, tokenizer, limits)
    assert sp.json_schema is None and 'start: "yes"\n     | /[0-9]/+' in sp.lark_grammar  # GBNF, as Lark
    lark = 'start: "a" b\nb: /[0-9]+/'
    outputs = {**COMPLETION, "structured_outputs": {"grammar": lark}}
    assert _sampling(CompletionRequest, outputs, tokenizer, limits).lark_grammar == lark
    choices = {"structured_outputs": {"choice": ['say "yes"', "no"]}}
    assert _sampling(ChatCompletionRequest, {**CHAT, **choices}, tokenizer, limits).lark_grammar == (
        'start: "say \\"yes\\"" | "no"'
    )


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        ({"guided_choice": ["a", 5]}, "guided_choice", "a list of non-empty strings"),
        ({"guided_choice": []}, "guided_choice", "a list of non-empty strings"),
        ({"guided_choice": [f"c{i}" for i in range(1025)]}, "guided_choice", "at most 1,024 choices"),
        ({"guided_regex": "ab\\"}, "guided_regex", "ends with an unfinished escape"),
        ({"structured_outputs": {"json_object": "no"}}, "structured_outputs", "json_object: must be a boolean"),
        ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}}, "structured_outputs", "whitespace_p"),
        ({"guided_json": "{no"}, "guided_json", "as an object or its JSON text"),
        ({"guided_json": {"type": "foo"}}, "guided_json", "cannot be used"),
        ({"guided_choice": ["a"], "guided_json": {"type": "object"}}, "guided_choice", "with guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "with response_format"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", "Rule 'x' not found"),
        ({"guided_grammar": "start: x"}, "guided_grammar", "unknown name"),
        ({"guided_grammar": " "}, "guided_grammar", "grammar of 1 to 32,768 characters"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag: '{}' is not"),
        ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
        ({"guided_choice": ["a"], "tools": [{"type": "function", "function": {"name": "f"}}]}, "guided_choice",
         "cannot be combined with tools"),
    ],
)  # fmt: skip
def test_vllm_s_output_constraints_are_refused_naming_the_field(tokenizer, limits, extra, param, text):
    error = _field_error(ChatCompletionRequest, {**CHAT, **extra}, tokenizer, limits)
    assert error.param == param and text in error.message, error.message


def test_vllm_s_chat_template_fields(tokenizer, limits):
    """add_generation_prompt, continue_final_message (an answer started by the client, continued)
    and chat_template_kwargs (the template's own variables)."""

    def prompt_tail(body: dict, chat: ChatSetup | None = None) -> str:
        request = ChatCompletionRequest.model_validate({**CHAT, **body}).to_generation_request(
            tokenizer, limits, chat=chat
        )
        return tokenizer.decode(request.prompt_token_ids)[-40:]

    assert prompt_tail({}).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_tail({"add_generation_prompt": False}).endswith("<|im_end|>\n")
    started = {"messages": [*CHAT["messages"], {"role": "assistant", "content": "Hello, I am"}]}
    continued = prompt_tail({**started, "add_generation_prompt": False, "continue_final_message": True})
    assert continued.endswith("<|im_start|>assistant\nHello, I am")
    template = ChatSetup(template="{% for m in messages %}{{ m.content }}{% endfor %} [{{ mood }}]")
    assert prompt_tail({"chat_template_kwargs": {"mood": "calm"}}, template).endswith(" [calm]")
    last = "the last message must be the assistant's"
    refusals = [
        ({"continue_final_message": True}, "continue_final_message", "needs add_generation_prompt false"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message", last),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools' is reserved"),
        ({"chat_template_kwargs": {"_private": 1}}, "chat_template_kwargs", "'_private' is reserved"),
        ({"chat_template_kwargs": {"conversations": 1}}, "chat_template_kwargs", "'conversations' is reserved"),
        ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs", "'self' is reserved"),
        ({"chat_template_kwargs": {"namespace": 0}}, "chat_template_kwargs", "'namespace' is reserved"),
        (
            {**started, "add_generation_prompt": False, "continue_final_message": True, "messages": [
                *started["messages"][:-1],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
            "continue_final_message", "without tool calls",
        ),
    ]  # fmt: skip
    for body, param, text in refusals:
        error = _field_error(ChatCompletionRequest, {**CHAT, **body}, tokenizer, limits)
        assert error.param == param and text in error.message, error.message
    # a variable the template uses in a way its type does not allow: the template's error, a 400
    template = ChatSetup(template="{{ messages[0].content }}{{ count + 1 }}")
    with pytest.raises(FieldError, match="chat_template_kwargs: the chat template failed on them") as info:
        prompt_tail({"chat_template_kwargs": {"count": "one"}}, template)
    assert info.value.param == "chat_template_kwargs"


def test_a_completion_s_text_gets_the_bos_a_llama_tokenizer_adds(tokenizer, limits):
    """As vLLM's completions: a text prompt gets the tokenizer's special tokens unless
    add_special_tokens is false; token ids and chats (their template writes the BOS) never."""
    from tokenizers import processors

    bos_adding = load_tokenizer(ModelSpec())  # the default model's, with a BOS as Llama's post-processor adds it
    bos_adding.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    plain = encode_prompt(bos_adding, "hi")
    assert _sampling_ids(CompletionRequest, COMPLETION, bos_adding, limits) == [1, *plain]
    assert _sampling_ids(CompletionRequest, {**COMPLETION, "add_special_tokens": False}, bos_adding, limits) == plain
    assert _sampling_ids(CompletionRequest, {**COMPLETION, "prompt": [5, 6]}, bos_adding, limits) == [5, 6]
    # a chat's ids are the template's alone: the same as with the tokenizer that adds no BOS
    assert _sampling_ids(ChatCompletionRequest, CHAT, bos_adding, limits) == encode_prompt(tokenizer, CHAT["messages"])
    assert unsupported(ChatCompletionRequest.model_validate({**CHAT, "add_special_tokens": True}))[0] == (
        "add_special_tokens"
    )


def _sampling_ids(schema: type, body: dict, tokenizer, limits) -> list[int]:
    return list(schema.model_validate(body).to_generation_request(tokenizer, limits).prompt_token_ids)


def test_max_tokens_defaults_as_openai_s(tokenizer, limits):
    """Completions: 16 when left out (within the room the prompt leaves), the rest of the
    context for an explicit null; chat: the rest of the context. A cap bounds each."""
    prompt = encode_prompt(tokenizer, "hi")
    room = limits.max_model_len - len(prompt)
    near_full = {**COMPLETION, "prompt": [100] * (limits.max_model_len - 5)}
    cases = [
        (CompletionRequest, COMPLETION, limits, 16),
        (CompletionRequest, {**COMPLETION, "max_tokens": None}, limits, room),
        (CompletionRequest, near_full, limits, 5),
        (CompletionRequest, COMPLETION, ContextLimits(max_model_len=2048, max_tokens=4), 4),
        (ChatCompletionRequest, CHAT, ContextLimits(max_model_len=2048, max_tokens=300), 300),
    ]
    for schema, body, bounds, expected in cases:
        assert _sampling(schema, body, tokenizer, bounds).max_tokens == expected, body


def test_echo_scores_the_prompt_when_logprobs_are_asked_and_max_tokens_0_generates_one(tokenizer, limits):
    echo = {**COMPLETION, "echo": True}
    echoed = _sampling(CompletionRequest, {**echo, "logprobs": 2, "max_tokens": 5}, tokenizer, limits)
    assert (echoed.prompt_logprobs, echoed.logprobs, echoed.max_tokens) == (2, 2, 5)
    assert _sampling(CompletionRequest, echo, tokenizer, limits).prompt_logprobs is None
    assert _sampling(CompletionRequest, {**COMPLETION, "logprobs": 1}, tokenizer, limits).prompt_logprobs is None
    alone = _sampling(CompletionRequest, {**echo, "max_tokens": 0, "logprobs": 0}, tokenizer, limits)
    assert (alone.max_tokens, alone.prompt_logprobs) == (1, 0)  # the answer drops the one token
    error = _field_error(CompletionRequest, {**COMPLETION, "max_tokens": 0}, tokenizer, limits)
    assert error.param == "max_tokens" and "at least 1" in str(error)
    error = _field_error(CompletionRequest, {**echo, "max_tokens": -1}, tokenizer, limits)
    assert error.param == "max_tokens" and "must be at least 0, got -1" in str(error)
    assert _sampling(ChatCompletionRequest, {**CHAT, "logprobs": True}, tokenizer, limits).prompt_logprobs is None


def test_vllms_prompt_logprobs_scores_the_prompt_with_the_most_alternatives_asked_and_never_streams(tokenizer, limits):
    asked = {**COMPLETION, "prompt_logprobs": 3}
    assert _sampling(CompletionRequest, asked, tokenizer, limits).prompt_logprobs == 3
    assert _sampling(ChatCompletionRequest, {**CHAT, "prompt_logprobs": 0}, tokenizer, limits).prompt_logprobs == 0
    both = {**asked, "echo": True, "logprobs": 5}  # the echo's alternatives and vLLM's, scored once
    assert _sampling(CompletionRequest, both, tokenizer, limits).prompt_logprobs == 5
    assert _sampling(CompletionRequest, {**both, "logprobs": 1}, tokenizer, limits).prompt_logprobs == 3
    for schema, body in ((CompletionRequest, asked), (ChatCompletionRequest, {**CHAT, "prompt_logprobs": 1})):
        error = _field_error(schema, {**body, "stream": True}, tokenizer, limits)
        assert error.param == "prompt_logprobs" and "not available when stream is true" in str(error)
        with pytest.raises(ValidationError, match="prompt_logprobs"):
            schema.model_validate({**body, "prompt_logprobs": 21})


def test_a_batched_completion_is_one_request_per_prompt(tokenizer, limits):
    batch = CompletionRequest.model_validate({**COMPLETION, "prompt": ["hi", [5, 6]], "seed": 7})
    requests = batch.to_generation_requests(tokenizer, limits, "cmpl-b")
    assert [r.request_id for r in requests] == ["cmpl-b-0", "cmpl-b-1"]
    assert [r.prompt_token_ids for r in requests] == [tuple(encode_prompt(tokenizer, "hi")), (5, 6)]
    assert [(r.sampling.max_tokens, r.sampling.seed) for r in requests] == [(16, 7), (16, 7)]
    one = CompletionRequest.model_validate(COMPLETION).to_generation_requests(tokenizer, limits, "cmpl-1")
    assert [r.request_id for r in one] == ["cmpl-1"]
    too_long = {**COMPLETION, "prompt": ["hi", [5] * limits.max_model_len]}
    error = _batch_error(too_long, tokenizer, limits)
    assert error.param == "prompt.1" and error.message.startswith("prompt.1: the prompt is 2048 tokens"), error
    error = _batch_error({**COMPLETION, "prompt": ["a"] * 5, "n": 16, "max_tokens": 1}, tokenizer, limits)
    assert (error.param, error.message) == ("prompt", "prompt: 5 prompts x n=16 is over 64 choices a request")
    error = _batch_error({**COMPLETION, "prompt": ["hi", ""]}, tokenizer, limits)
    assert (error.param, error.message) == ("prompt.1", "prompt.1 must not be empty")


def _batch_error(body: dict, tokenizer, limits) -> FieldError:
    with pytest.raises(FieldError) as info:
        CompletionRequest.model_validate(body).to_generation_requests(tokenizer, limits, "cmpl-b")
    return info.value


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"stop": ["1", "2", "3", "4", "5"]}, "stop", "at most 4 strings"),
        ({"logit_bias": {"49152": 5}}, "logit_bias", "token id 49152 is out of vocabulary"),
        ({"logit_bias": {"dog": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"stop_token_ids": [2, 49152]}, "stop_token_ids", "token id 49152 is out of vocabulary"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "a list of token ids"),
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
        ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}  # fmt: skip
CALLED = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
]  # fmt: skip


def test_n_is_bounded_and_tools_are_served():
    assert unsupported(ChatCompletionRequest.model_validate({**CHAT, "n": 2})) is None
    for bad in (0, 17):
        with pytest.raises(ValidationError, match="n"):
            ChatCompletionRequest.model_validate({**CHAT, "n": bad})
    body = {**CHAT, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    assert unsupported(ChatCompletionRequest.model_validate(body)) is None


def test_tools_and_their_history_render_through_the_chat_template(tokenizer, limits):
    chat = ChatSetup.of(tokenizer.chat_template, None, None, None)  # the model's renders no tools
    assert chat.tool_parser is not None and chat.tool_parser.name == "hermes"
    body = ChatCompletionRequest.model_validate({**CHAT, "messages": CALLED, "tools": [WEATHER]})
    text = tokenizer.decode(body.to_generation_request(tokenizer, limits, chat=chat).prompt_token_ids)
    assert '"name": "get_weather"' in text and "<tools>" in text and "<tool_response>\n18 C\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    plain = ChatCompletionRequest.model_validate(CHAT).to_generation_request(tokenizer, limits, chat=chat)
    assert list(plain.prompt_token_ids) == encode_prompt(tokenizer, CHAT["messages"])  # the model's own template
    with pytest.raises(FieldError, match="renders no tools") as info:
        body.to_generation_request(tokenizer, limits, chat=ChatSetup.of("{{ messages }}", None, None, None))
    assert info.value.param == "tools"


def test_a_forced_call_is_generated_under_its_schema(tokenizer, limits):
    named = {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    schema = json.loads(_sampling(ChatCompletionRequest, named, tokenizer, limits).json_schema)
    assert schema["properties"]["city"] == {"type": "string"} and schema["properties"]["days"]["maximum"] == 2**53 - 1
    required = {**CHAT, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    schema = json.loads(_sampling(ChatCompletionRequest, required, tokenizer, limits).json_schema)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    auto = _sampling(ChatCompletionRequest, {**CHAT, "tools": [WEATHER]}, tokenizer, limits)
    assert auto.json_schema is None and '"<tool_call>"' in auto.lark_grammar  # hermes: free text until a call
    assert (
        _sampling(ChatCompletionRequest, {**CHAT, "tools": [WEATHER], "tool_choice": "none"}, tokenizer, limits).grammar
        is None
    )


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "no"}}}, "tool_choice", "no"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
        ({"messages": [CALLED[0], {**CALLED[2], "tool_call_id": "c9"}]}, "messages.1.tool_call_id", "c9"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "forced"),
    ],
)  # fmt: skip
def test_tool_refusals_name_the_field(extra, param, text, tokenizer, limits):
    error = _field_error(ChatCompletionRequest, {**CHAT, **extra}, tokenizer, limits)
    assert error.param == param and text in str(error)


@pytest.mark.parametrize(
    ("tool", "loc"),
    [
        (
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
            "tools.0.function.parameters",
        ),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}, "tools.0.function.parameters"),
        ({"type": "function", "function": {"name": "bad name!"}}, "tools.0.function.name"),
        ({"type": "retrieval"}, "tools.0.type"),
    ],
)
def test_malformed_tools_are_refused_naming_the_field(tool, loc):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, "tools": [tool]})
    assert validation_error_body(info.value)["error"]["param"] == loc
