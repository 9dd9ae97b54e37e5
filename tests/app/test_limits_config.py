"""The ``limits`` and ``auth`` sections: defaults, bad values refused at start naming the field,
key files read as documented, and no key in any message or repr."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import AppConfig
from engine.params import ContextLimits, FieldError, check_fits

KEY = "sk-tandem-0123456789abcdef"


def test_defaults_leave_auth_off_and_the_context_as_the_only_token_bound():
    config = AppConfig.load({}, environ={})
    limits = config.limits
    assert (limits.max_body_bytes, limits.max_prompt_tokens, limits.max_tokens) == (4 << 20, None, None)
    assert (limits.max_concurrent_per_key, limits.stream_idle_timeout_s) == (None, 60.0)
    assert not config.auth.enabled and config.auth.keys() == []


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"limits.max_body_bytes": "100"}, "limits.max_body_bytes"),
        ({"limits.max_prompt_tokens": "0"}, "limits.max_prompt_tokens"),
        ({"limits.max_tokens": "-1"}, "limits.max_tokens"),
        ({"limits.max_concurrent_per_key": "0"}, "limits.max_concurrent_per_key"),
        ({"limits.stream_idle_timeout_s": "0"}, "limits.stream_idle_timeout_s"),
        ({"limits.max_tokens": "many"}, "limits.max_tokens"),
        ({"limits.burst": "3"}, "limits.burst"),
        ({"auth.api_keys": "[' ']"}, "auth.api_keys"),
        ({"auth.api_keys": "['two words']"}, "auth.api_keys"),
        ({"auth.keys": "[a]"}, "auth.keys"),
    ],
)
def test_bad_values_are_refused_naming_the_field(args, field):
    with pytest.raises(ValidationError) as caught:
        AppConfig.load(args, environ={})
    assert field in str(caught.value)


def test_key_file_skips_comments_and_blank_lines_and_adds_to_inline_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# production keys\n\n  {KEY}  \n# rotated out: none\nsk-second\n")
    config = AppConfig.load({"auth.api_keys": "[sk-inline]", "auth.api_keys_file": str(path)}, environ={})
    assert config.auth.enabled and config.auth.keys() == ["sk-inline", KEY, "sk-second"]
    assert KEY not in repr(config) and "sk-inline" not in repr(config)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (None, "cannot read"),
        ("# only a comment\n\n", "holds no key"),
        (f"{KEY}\n{KEY} trailing words\n", "line 2: the key has a character outside printable ASCII"),
    ],
)
def test_unusable_key_file_is_refused_naming_the_field_and_no_key(tmp_path, text, problem):
    path = tmp_path / "keys"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValidationError) as caught:
        AppConfig.load({"auth.api_keys_file": str(path)}, environ={})
    message = str(caught.value)
    assert "auth.api_keys_file" in message and problem in message and KEY not in message


def test_token_caps_refuse_naming_the_clients_field_and_bound_the_default():
    limits = ContextLimits(max_model_len=100, max_prompt_tokens=10, max_tokens=8)
    with pytest.raises(FieldError) as caught:
        check_fits(list(range(11)), 1, limits, prompt_field="messages")
    assert caught.value.param == "messages" and "limits.max_prompt_tokens" in caught.value.message
    with pytest.raises(FieldError) as caught:
        check_fits(list(range(10)), 9, limits, max_tokens_field="max_completion_tokens")
    assert caught.value.param == "max_completion_tokens" and "limit of 8" in caught.value.message
    check_fits(list(range(10)), 8, limits)
    assert limits.default_max_tokens(10) == 8 and ContextLimits(max_model_len=100).default_max_tokens(10) == 90
    assert ContextLimits(max_model_len=100, max_tokens=8).default_max_tokens(95) == 5
