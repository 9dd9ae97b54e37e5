"""A full ingress answers 503 with Retry-After, then serves normally again."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from ray import serve

from bench.ray_local import start_local_ray

PORT = 18434
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


@pytest.fixture(scope="module")
def url():
    from app.config import colocated_app

    start_local_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {
        "model.max_model_len": "512",
        "engine.kv_cache_bytes": str(32 << 20),
        "colocated.num_replicas": "1",
        "max_queued_requests": "1",
    }
    serve.run(colocated_app(args), name="busy", route_prefix="/")
    yield f"http://127.0.0.1:{PORT}/v1/chat/completions"
    serve.shutdown()
    ray.shutdown()


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
    deadline = time.monotonic() + 20  # the closed stream leaves the ingress asynchronously
    while time.monotonic() < deadline:
        after = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}, timeout=60)
        if after.status_code != 503:
            break
        time.sleep(0.2)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
