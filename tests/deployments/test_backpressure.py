"""A full ingress answers 503 with Retry-After, then serves normally again."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.serving import SMALL_COLOCATED, ServeApp
from tests.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


@pytest.fixture(scope="module")
def url(shared_serve) -> Iterator[str]:
    from app.config import colocated_app

    args = {
        **SMALL_COLOCATED,
        "max_queued_requests": "1",
    }
    with shared_serve.apps([ServeApp("backpressure", colocated_app, args)]) as served:
        yield served.url("backpressure") + "/v1/chat/completions"


def test_full_ingress_answers_503_with_retry_after(url):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # held: a collected iterator would close the stream
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # the first request is now streaming tokens
        second = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4}, timeout=60)
    assert second.status_code == 503 and second.headers["retry-after"] == "1"
    assert second.json()["error"] == {
        "message": "server busy: too many requests in flight",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    after = wait_until(  # the closed stream leaves the ingress asynchronously
        lambda: httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}, timeout=60),
        20,
        "the ingress to take a request again after the first stream closed",
        until=lambda r: r.status_code != 503,
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
