"""The Serve applications through real HTTP on a local Ray cluster.

Three applications in one Serve instance: ``disagg_app`` with pull (at /), ``disagg_app``
with push (at /push), and ``colocated_app`` with one replica (at /colo).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import ray
from ray import serve

from bench.ray_local import start_local_ray

PORT = 18431
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def base_url():
    from app.config import disagg_app

    start_local_ray()
    from app.config import colocated_app

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    common = {
        "model.max_model_len": "1024",
        "engine.kv_cache_bytes": str(64 << 20),
        "prefill.num_cpus": "0.25",
        "decode.num_cpus": "0.25",
        "colocated.num_cpus": "0.25",
        "colocated.num_replicas": "1",
    }
    serve.run(disagg_app(common), name="disagg", route_prefix="/", blocking=False)
    serve.run(disagg_app({**common, "transport.mode": "push"}), name="push", route_prefix="/push", blocking=False)
    serve.run(colocated_app(common), name="colo", route_prefix="/colo")
    _wait_ready(f"http://127.0.0.1:{PORT}", ["", "/push", "/colo"])
    yield f"http://127.0.0.1:{PORT}"
    serve.shutdown()
    ray.shutdown()


def _wait_ready(url: str, prefixes: list[str], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(prefixes)
    while pending and time.monotonic() < deadline:
        try:
            if httpx.get(url + pending[0] + "/ready", timeout=5).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    assert not pending, f"applications not ready: {pending}"


@pytest.fixture(params=["", "/push", "/colo"], ids=["pull", "push", "colocated"])
def url(request, base_url):
    return base_url + request.param


def _post(url: str, path: str, body: dict | str, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=120)


def _sse_events(response: httpx.Response) -> list[str]:
    """Parse server-sent events strictly: each event is one 'data: ...' line and a blank line."""
    events, lines = [], response.text.split("\n")
    assert response.text.endswith("\n\n")
    for i in range(0, len(lines) - 1, 2):
        if lines[i] == "" and i == len(lines) - 2:
            break
        assert lines[i].startswith("data: ") and lines[i + 1] == "", lines[i : i + 2]
        events.append(lines[i][len("data: ") :])
    return events


def _stats(name: str):
    return ray.get(serve.get_deployment_handle(name, app_name="disagg").stats.remote()._to_object_ref_sync())


def test_models_and_health(base_url):
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    modes = [httpx.get(base_url + p + "/ready").json()["mode"] for p in ("", "/push", "/colo")]
    assert modes == ["disaggregated-pull", "disaggregated-push", "colocated"]
    models = httpx.get(base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_chat_greedy(url):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0}
    r = _post(url, "/v1/chat/completions", body, headers={"X-Request-Id": f"client-id-{url[-4:]}"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "The capital of France is Paris."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] > 20
    assert body["id"] == f"client-id-{url[-4:]}"


def test_chat_streamed_with_usage(url):
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "The capital of France is Paris."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_min_tokens_holds_back_eos(url):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 20, "min_tokens": 12}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 12  # 8 without min_tokens
    assert r.json()["choices"][0]["message"]["content"].startswith("The capital of France is Paris.")


def test_completion_with_token_prompt_and_length(url):
    r = _post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "X": 1},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ("{not json", 400, None, "malformed JSON"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 10**9}, 400, "max_tokens", "beyond the context"),
        ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, "temperature", "temperature"),
        ({"model": MODEL, "messages": QUESTION, "top_p": 1.5}, 400, "top_p", "top_p"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages", "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 1100}]}, 400, "messages", "1024"),
        ({"model": "gpt-9", "messages": QUESTION}, 404, "model", "gpt-9"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens", "min_tokens"),
    ],
)
def test_bad_input_gets_a_named_error(base_url, body, status, param, text):
    r = _post(base_url, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"]
    assert "Traceback" not in r.text
    ok = _post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert ok.status_code == 200


def test_duplicate_client_request_id_is_refused_while_in_flight(base_url):
    long = {"model": MODEL, "messages": QUESTION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    headers = {"X-Request-Id": "same-id"}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=long, headers=headers, timeout=60) as first:
        lines = first.iter_lines()  # held: a collected iterator would close the stream
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        second = _post(base_url, "/v1/chat/completions", short, headers=headers)
        assert second.status_code == 400, second.text
        assert second.json()["error"]["param"] == "X-Request-Id" and "already in flight" in second.text
        assert sum(1 for _ in lines) > 0  # the first request still streams to the end
    again = _post(base_url, "/v1/chat/completions", short, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == "same-id"


def test_client_disconnect_frees_blocks_on_both_replicas(base_url):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 10:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        decode, prefill = _stats("DecodeServer"), _stats("PrefillServer")
        if decode.num_free_blocks == decode.num_total_blocks and prefill.num_free_blocks == prefill.num_total_blocks:
            break
        time.sleep(0.2)
    assert (decode.num_running, decode.num_free_blocks) == (0, decode.num_total_blocks)
    assert (prefill.num_pinned_blocks, prefill.num_free_blocks) == (0, prefill.num_total_blocks)
