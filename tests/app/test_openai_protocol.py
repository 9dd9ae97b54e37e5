"""Request bodies at the edge: what is accepted, and the field a refusal names."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.openai_protocol import (
    SURROGATE_ESCAPE,
    ChatCompletionRequest,
    CompletionRequest,
    lone_surrogate,
    unsupported,
    validation_error_body,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _refusal(schema: type, body: dict | str) -> dict:
    data = json.loads(body) if isinstance(body, str) else body
    with pytest.raises(ValidationError) as info:
        schema.model_validate(data)
    return validation_error_body(info.value)["error"]


@pytest.mark.parametrize(
    ("schema", "body", "param", "text"),
    [
        (CompletionRequest, {"model": "m", "prompt": [[1, 2], [3, True]]}, "prompt.1.1", "valid integer"),
        (CompletionRequest, {"model": "m", "prompt": ["a", 5]}, "prompt.1", "valid string"),
        (CompletionRequest, {"model": "m", "prompt": [True]}, "prompt.0", "valid integer"),
        (
            CompletionRequest,
            {"model": "m", "prompt": [["a", "b"]]},
            "prompt.0.0",
            "valid integer",
        ),  # nested once too often
        (CompletionRequest, {"model": "m", "prompt": None}, "prompt", "valid string"),
        (CompletionRequest, {"model": None, "prompt": "x"}, "model", "valid string"),
        (CompletionRequest, {"model": "m", "prompt": [1, True]}, "prompt.1", "valid integer"),
        (CompletionRequest, {"model": "m", "prompt": [1, "2"]}, "prompt.1", "valid integer"),
        (CompletionRequest, {"model": "m", "prompt": 5}, "prompt", "valid string"),
        (CompletionRequest, {"model": "m"}, "prompt", "required"),
        (CompletionRequest, {**COMPLETION, "logprobs": 21}, "logprobs", "less than or equal to 20"),
        (CompletionRequest, '{"model": "m", "prompt": "hi", "temperature": NaN}', "temperature", "finite"),
        (CompletionRequest, '{"model": "m", "prompt": "hi", "top_p": Infinity}', "top_p", "finite"),
        (CompletionRequest, {**COMPLETION, "seed": 2**64}, "seed", "less than"),
        (ChatCompletionRequest, {**CHAT, "messages": []}, "messages", "at least 1"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": 3}]}, "messages.0.content", "string"),
        (
            ChatCompletionRequest,
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "content parts of type 'image_url' are not supported",
        ),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 30}, "top_logprobs", "less than or equal to 20"),
        # JSON types as OpenAI's API checks them: no boolean, string or fraction for an integer,
        # no string for a number, no number or string for a boolean
        (ChatCompletionRequest, {**CHAT, "max_tokens": True}, "max_tokens", "valid integer"),
        (ChatCompletionRequest, {**CHAT, "max_tokens": "10"}, "max_tokens", "valid integer"),
        (ChatCompletionRequest, {**CHAT, "n": 2.0}, "n", "valid integer"),
        (ChatCompletionRequest, {**CHAT, "temperature": "0.5"}, "temperature", "valid number"),
        (ChatCompletionRequest, {**CHAT, "temperature": False}, "temperature", "valid number"),
        (ChatCompletionRequest, {**CHAT, "stream": "true"}, "stream", "valid boolean"),
        (ChatCompletionRequest, {**CHAT, "logprobs": 1}, "logprobs", "valid boolean"),
        (CompletionRequest, {**COMPLETION, "logprobs": True}, "logprobs", "valid integer"),
        (CompletionRequest, {**COMPLETION, "echo": "yes"}, "echo", "valid boolean"),
        (
            ChatCompletionRequest,
            {**CHAT, "messages": [{"role": "robot", "content": "x"}, {"role": "user", "content": 5}]},
            "messages.0.role",
            "'user'",
        ),
    ],
)
def test_refusals_name_the_field(schema, body, param, text):
    error = _refusal(schema, body)
    assert error["param"] == param and text in error["message"], error
    assert error["message"].startswith(f"{param}: ") and "Value error" not in error["message"]


def test_text_parts_are_joined_and_developer_is_system():
    body = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            ],
        }
    )
    assert [m.for_template() for m in body.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one\ntwo"},
    ]


@pytest.mark.parametrize(
    ("schema", "extra", "param"),
    [
        (CompletionRequest, {"best_of": 3}, "best_of"),
        (CompletionRequest, {"suffix": "end"}, "suffix"),
        (CompletionRequest, {"use_beam_search": True}, "use_beam_search"),
        (CompletionRequest, {"logits_processors": ["a.b"]}, "logits_processors"),
        (ChatCompletionRequest, {"structural_tag": "{}"}, "structural_tag"),
        (ChatCompletionRequest, {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        (ChatCompletionRequest, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        (ChatCompletionRequest, {"function_call": {"name": "f"}}, "function_call"),
        (ChatCompletionRequest, {"modalities": ["text", "audio"]}, "modalities"),
        (ChatCompletionRequest, {"documents": [{"title": "a", "text": "b"}]}, "documents"),
        (ChatCompletionRequest, {"best_of": 2}, "best_of"),
    ],
)
def test_set_but_unsupported_fields_are_named(schema, extra, param):
    base = CHAT if schema is ChatCompletionRequest else COMPLETION
    field, message = unsupported(schema.model_validate({**base, **extra}))
    assert field == param and message.startswith(f"{param}: ") and "not supported" in message


@pytest.mark.parametrize(
    ("schema", "extra"),
    [
        (ChatCompletionRequest, {"n": 1, "presence_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"}}),
        (ChatCompletionRequest, {"tools": [], "tool_choice": "none", "user": "u-1", "unknown_field": 1}),
        (CompletionRequest, {"echo": False, "best_of": 1, "suffix": "", "frequency_penalty": 0.0}),
        # vLLM's defaults, as its clients may send them; unknown fields are ignored
        (CompletionRequest, {"use_beam_search": False, "skip_special_tokens": True, "guided_json": None, "x": [1]}),
        (ChatCompletionRequest, {"modalities": ["text"], "add_generation_prompt": True, "bad_words": [], "echo": 0}),
        (ChatCompletionRequest, {"function_call": "none", "guided_decoding_backend": "xgrammar"}),
    ],
)
def test_neutral_values_of_unsupported_fields_pass(schema, extra):
    base = CHAT if schema is ChatCompletionRequest else COMPLETION
    assert unsupported(schema.model_validate({**base, **extra})) is None


def test_null_means_the_default_and_a_batch_of_one_is_its_prompt():
    """As the openai SDK sends a None it was given, and lm-eval-harness a one-prompt batch."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "presence_penalty", "logprobs", "seed", "stop"])
    chat = ChatCompletionRequest.model_validate({**CHAT, **nulls})
    assert (chat.temperature, chat.top_p, chat.n, chat.stream, chat.logprobs, chat.seed) == (
        1.0,
        1.0,
        1,
        False,
        False,
        None,
    )
    assert unsupported(chat) is None
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": ["one prompt"], "echo": None, "best_of": None}
    )
    assert completion.prompt == "one prompt" and unsupported(completion) is None
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]]}).prompt == [5, 6]


@pytest.mark.parametrize(
    ("raw", "param", "text"),
    [
        (r'{"prompt": "a\ud800b"}', "prompt", "prompt: a lone surrogate (\\ud800) is not valid Unicode text"),
        (r'{"prompt": ["ok", "b\uDBFFz"]}', "prompt.1", "(\\udbff)"),
        (r'{"messages": [{"role": "user", "content": "x\udc00"}]}', "messages.0.content", "(\\udc00)"),
        (r'{"tools": [{"function": {"parameters": {"k\udfff": {}}}}]}', "tools.0.function.parameters", "a key with"),
        (r'{"a\ud800": 1}', None, "the body: a key with a lone surrogate"),
        (r'{"prompt": "\ud83d\ude00 \\ud800"}', None, None),  # a pair is one character; an escaped backslash
    ],
)
def test_a_lone_surrogate_is_named_a_pair_passes(raw, param, text):
    """JSON escapes can spell a surrogate that no UTF-8 text holds; the tokenizer would raise a
    TypeError on it, so the edge refuses it naming its field (the ingress reads the body as strict
    UTF-8 first: raw surrogate bytes are malformed)."""
    assert SURROGATE_ESCAPE.search(raw)  # looked for further only then
    error = lone_surrogate(raw, json.loads(raw))
    if text is None:
        assert error is None
    else:
        assert error is not None and error.param == param and text in error.message, error
