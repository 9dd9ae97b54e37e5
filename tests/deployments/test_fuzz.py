"""Fuzzing the served app through its own published schema (``GET /openapi.json``) with
schemathesis: bodies that follow the schema (positive) and bodies that break it (negative),
for every operation, at most ``sum(PLAN.values())`` cases in all, reproducible (hypothesis
derandomized, no example database). Every answer must be below 500, every 4xx an OpenAI-style
error body, and no stream may carry a server error. Auth is on (the fuzzer sends the key), and
``limits.max_tokens`` keeps each generated request short."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.deployments.keyed_app import FUZZ_KEY as KEY
from tests.deployments.keyed_app import MAX_TOKENS
from tests.tiny_models import TINY_SERVED_NAME

MODEL = TINY_SERVED_NAME
POST_PATHS = ("/v1/chat/completions", "/v1/completions")
# cases per (method, path, mode); GET operations not listed get GET_CASES each
PLAN = {
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE): 30,
    ("POST", "/v1/completions", GenerationMode.POSITIVE): 40,
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE): 25,
    ("POST", "/v1/completions", GenerationMode.NEGATIVE): 25,
    ("POST", "/v1/responses", GenerationMode.POSITIVE): 25,
    ("POST", "/v1/responses", GenerationMode.NEGATIVE): 15,
    ("POST", "/tokenize", GenerationMode.POSITIVE): 15,
    ("POST", "/tokenize", GenerationMode.NEGATIVE): 10,
    ("POST", "/detokenize", GenerationMode.POSITIVE): 10,
    ("POST", "/detokenize", GenerationMode.NEGATIVE): 10,
}
SERVER_CODES = ("server_error", "kv_transfer_failed", "replica_unavailable", "timeout")  # deployments/http_errors.py
GET_CASES = 5  # an operation without parameters has one distinct case: hypothesis sends it once


@pytest.fixture(scope="module")
def url(keyed_url: str) -> str:
    return keyed_url


def _served_model(case: schemathesis.Case) -> schemathesis.Case:
    """The served model's name where the case has a string one: a random name only ever gets
    the 404, and the point is to reach the parsing, tokenizing and generating behind it."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body = {**case.body, "model": MODEL}
    return case


def _check(case: schemathesis.Case, response: schemathesis.Response) -> None:
    described = f"{case.method} {case.path} {json.dumps(case.body, default=str)[:2000]} -> {response.status_code}"
    assert response.status_code < 500, f"{described}: {response.content[:2000]!r}"
    if response.status_code >= 400:
        error = json.loads(response.content)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), described
        assert "param" in error and "code" in error, described
    elif any(k.lower() == "content-type" and v[0].startswith("text/event-stream") for k, v in response.headers.items()):
        for line in response.content.decode().splitlines():
            data = json.loads(line[len("data: ") :]) if line.startswith("data: {") else {}
            if data.get("type") == "error":  # a Responses stream's failure after its start
                assert data["code"] not in SERVER_CODES, described
            elif isinstance(data.get("error"), dict):  # a chunk's
                assert data["error"]["type"] != "server_error", described


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, num_cases: int, base_url: str) -> None:
    strategy = operation.as_strategy(mode, headers={"Authorization": f"Bearer {KEY}"}).map(_served_model)

    # derandomized: the same cases every run; not shrunk: a failure reports its case as found
    @settings(
        max_examples=num_cases,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        _check(case, case.call(base_url=base_url, timeout=120))

    run()


def test_the_schema_describes_the_request_bodies_and_the_errors(url):
    schema = httpx.get(url + "/openapi.json", timeout=10).json()
    assert schema["openapi"].startswith("3.1")
    for path, model in zip(POST_PATHS, ("ChatCompletionRequest", "CompletionRequest"), strict=True):
        operation = schema["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"} and operation["requestBody"]["required"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(operation["responses"])
        assert operation["responses"]["429"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    components = schema["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage", "ResponseFormat", "ErrorResponse"} <= set(
        components
    )
    assert components["ChatCompletionRequest"]["required"] == ["model", "messages"]


def test_every_operation_answers_below_500_and_refuses_in_openai_style(url):
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=schemathesis.Config())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {("POST", path) for path in POST_PATHS}
    for operation in operations:
        if operation.method.upper() == "GET":
            _fuzz(operation, GenerationMode.POSITIVE, GET_CASES, url)
    for (method, path, mode), num_cases in PLAN.items():
        _fuzz(schema[path][method], mode, num_cases, url)


def test_max_tokens_null_or_left_out_gets_at_most_the_servers_cap(url):
    """null asks for the rest of the context and left out for 16 (a completion's default): the
    server's cap (``limits.max_tokens``, 4 here) bounds both, as it does a chat left without one."""
    for path, fields in [
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": None}),
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ]:
        body = {"model": MODEL, "ignore_eos": True, **fields}
        response = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == MAX_TOKENS, fields


def _complete(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", **fields}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_sampling_extremes_the_fuzzer_found_are_served_or_refused_not_500(url):
    """Found by the fuzzer (top_p and repetition_penalty 5e-324 gave a 500, the engine step
    failing for every request in it): a top_p below float32's resolution keeps the most likely
    token (the greedy answer); a repetition_penalty far from 1 is refused naming it."""
    greedy = _complete(url, temperature=0)
    tiny_top_p = _complete(url, top_p=5e-324, seed=1)
    assert tiny_top_p.status_code == 200, tiny_top_p.text
    assert tiny_top_p.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    for value in (5e-324, 1e308):
        error = _complete(url, repetition_penalty=value).json()["error"]
        assert error["param"] == "repetition_penalty"
