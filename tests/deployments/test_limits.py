"""The ingress's limits on the served app (``limits``): body size (413, with and without
``Content-Length``), prompt tokens and ``max_tokens`` (400 naming the client's field), and
requests in flight per API key (429 with ``Retry-After``, the slot held until the stream
ends and given back however it ends)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.serving import SMALL_COLOCATED, ServeApp
from tests.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "sk-tandem-limits-a1b2c3", "sk-tandem-limits-d4e5f6"
MAX_BODY_BYTES = 65536
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


@pytest.fixture(scope="module")
def url(shared_serve) -> Iterator[str]:
    from app.config import colocated_app

    args = {
        **SMALL_COLOCATED,
        "auth.api_keys": f"[{KEY_A}, {KEY_B}]",
        "limits.max_body_bytes": str(MAX_BODY_BYTES),
        "limits.max_prompt_tokens": "64",
        "limits.max_tokens": "200",
        "limits.max_concurrent_per_key": "1",
    }
    with shared_serve.apps([ServeApp("limits", colocated_app, args)]) as served:
        yield served.url("limits")


def _post(url: str, path: str, body: dict, key: str = KEY_A, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def _chunked(data: bytes, size: int = 8192) -> Iterator[bytes]:
    """A body httpx sends without Content-Length (Transfer-Encoding: chunked)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_a_body_over_the_limit_is_refused_413_with_or_without_content_length(url):
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES, "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    declared = httpx.post(url + "/v1/completions", content=big, headers=headers, timeout=60)
    chunked = httpx.post(url + "/v1/completions", content=_chunked(big), headers=headers, timeout=60)
    assert "content-length" not in chunked.request.headers and chunked.request.headers["transfer-encoding"] == "chunked"
    for response in (declared, chunked):
        assert _error(response, 413) == {
            "message": f"the request body is over {MAX_BODY_BYTES} bytes (limits.max_body_bytes)",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    small = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    served = httpx.post(url + "/v1/completions", content=_chunked(small, 7), headers=headers, timeout=60)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 1


def test_max_tokens_over_the_limit_is_refused_naming_the_field(url):
    for field, path, body in [
        ("max_tokens", "/v1/chat/completions", {"messages": MESSAGES}),
        ("max_completion_tokens", "/v1/chat/completions", {"messages": MESSAGES}),
        ("max_tokens", "/v1/completions", {"prompt": "Hi"}),
    ]:
        error = _error(_post(url, path, {"model": MODEL, **body, field: 201}), 400)
        assert error["param"] == field
        assert error["message"] == f"{field}: 201 is over this server's limit of 200 (limits.max_tokens)"


def test_a_prompt_over_the_limit_is_refused_naming_the_prompt_field(url):
    error = _error(_post(url, "/v1/completions", {"model": MODEL, "prompt": [100] * 65, "max_tokens": 1}), 400)
    assert error["param"] == "prompt"
    assert (
        error["message"] == "prompt: the prompt is 65 tokens, over this server's limit of 64 (limits.max_prompt_tokens)"
    )
    long_chat = [{"role": "user", "content": "rivers and lakes " * 40}]
    error = _error(_post(url, "/v1/chat/completions", {"model": MODEL, "messages": long_chat, "max_tokens": 1}), 400)
    assert error["param"] == "messages" and "(limits.max_prompt_tokens)" in error["message"]


def _served_again(url: str, key: str) -> httpx.Response:
    return wait_until(  # a closed stream leaves the ingress asynchronously
        lambda: _post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}, key),
        20,
        "the key's slot to be given back",
        until=lambda r: r.status_code != 429,
    )


def test_a_second_request_with_the_same_key_waits_for_the_first_stream(url):
    held = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=held, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60
    ) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # held: a collected iterator would close the stream
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # the first request is now streaming tokens
        second = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
        other_key = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}, KEY_B)
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"] == {
        "message": "this API key has 1 requests in flight (limits.max_concurrent_per_key)",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert other_key.status_code == 200
    assert _served_again(url, KEY_A).status_code == 200  # the first stream's client went away: slot back
    finished = {**held, "max_tokens": 3}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=finished, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60
    ) as done:
        assert [line for line in done.iter_lines() if line][-1] == "data: [DONE]"
    third = _served_again(url, KEY_A)  # the stream was sent to its end: slot back
    assert third.status_code == 200 and third.json()["usage"]["completion_tokens"] == 1
