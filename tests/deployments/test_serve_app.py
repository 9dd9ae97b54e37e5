"""The Serve applications through real HTTP on a local Ray cluster.

Three applications on the session's Serve: ``disagg_app`` with pull (at /serve) and with push
(at /serve/push), both with speculative decoding, and ``colocated_app`` with one replica and
without it (at /serve/colo). Every greedy test that compares paths so also checks that
speculation changes no token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from tests.serving import SERVED_COMMON, SERVED_CONTEXT, SPECULATIVE, ServeApp, ServedApps, served_disagg
from tests.waiting import ok_json, wait_until

ROOT = "/serve"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(shared_serve) -> Iterator[ServedApps]:
    from app.config import colocated_app, disagg_app

    apps = [
        served_disagg(),
        ServeApp(
            "push", disagg_app, {**SERVED_COMMON, **SPECULATIVE, "transport.mode": "push"}, route_prefix=f"{ROOT}/push"
        ),
        ServeApp("colo", colocated_app, SERVED_COMMON, route_prefix=f"{ROOT}/colo"),
    ]
    with shared_serve.apps(apps) as served:
        yield served


@pytest.fixture(scope="module")
def base_url(served: ServedApps) -> str:
    return served.url("disagg")


@pytest.fixture(params=["", "/push", "/colo"], ids=["pull", "push", "colocated"])
def url(request, base_url):
    return base_url + request.param


def _post(url: str, path: str, body: dict | str | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
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


def _stats(served: ServedApps, deployment: str):
    return ray.get(served.handle(deployment, app="disagg").stats.remote()._to_object_ref_sync())


def test_models_and_health(base_url):
    assert httpx.get(base_url + "/health", timeout=30).json() == {"status": "ok"}
    modes = [httpx.get(base_url + p + "/ready", timeout=30).json()["mode"] for p in ("", "/push", "/colo")]
    assert modes == ["disaggregated-pull", "disaggregated-push", "colocated"]
    models = httpx.get(base_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert isinstance(models["data"][0]["created"], int)
    assert httpx.get(f"{base_url}/v1/models/{MODEL}", timeout=30).json() == models["data"][0]  # OpenAI's retrieve
    unknown = httpx.get(base_url + "/v1/models/org/other-model", timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "The model `org/other-model` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


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
    assert not any("usage" in c for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk has the usage so far, the last chunk the whole
    body["stream_options"]["continuous_usage_stats"] = True
    counted = [json.loads(e) for e in _sse_events(_post(url, "/v1/chat/completions", body))[:-1]]
    assert [c["usage"]["completion_tokens"] for c in counted][:2] == [0, 1]
    assert counted[-2]["usage"]["completion_tokens"] == counted[-1]["usage"]["completion_tokens"] == 8
    assert {c["usage"]["prompt_tokens"] for c in counted} == {chunks[-1]["usage"]["prompt_tokens"]}


def test_stop_token_ids_end_the_answer_without_their_text(url):
    """vLLM's stop_token_ids (" France" is 4649): the answer ends there, the token counted, its text left out."""
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "stop_token_ids": [4649]}
    r = _post(url, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "The capital of"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert r.json()["usage"]["completion_tokens"] == 4


def test_a_kept_stop_string_or_token_ends_the_answer_with_its_text(url):
    """vLLM's include_stop_str_in_output, streamed and not: the answer ends with what stopped it."""
    for stop in ({"stop": ["France"]}, {"stop_token_ids": [4649]}):
        body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "include_stop_str_in_output": True, **stop}
        r = _post(url, CHAT, body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "The capital of France"
        chunks = [json.loads(e) for e in _sse_events(_post(url, CHAT, {**body, "stream": True}))[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "The capital of France"


def test_tokenize_gives_the_prompt_a_request_is_charged_for_and_detokenize_its_text(base_url):
    """vLLM's /tokenize (a chat and a completion's text) and /detokenize."""
    chat = _post(base_url, "/tokenize", {"model": MODEL, "messages": QUESTION, "return_token_strs": True}).json()
    answer = _post(base_url, CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 1}).json()
    assert chat["count"] == len(chat["tokens"]) == answer["usage"]["prompt_tokens"]
    assert chat["max_model_len"] == SERVED_CONTEXT and len(chat["token_strs"]) == chat["count"]
    text = _post(base_url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?" in text
    plain = _post(base_url, "/tokenize", {"prompt": "Hello world"}).json()
    assert plain == {"count": 2, "max_model_len": SERVED_CONTEXT, "tokens": [19556, 905], "token_strs": None}
    assert _post(base_url, "/detokenize", {"model": MODEL, "tokens": [19556, 905]}).json() == {"prompt": "Hello world"}
    refused = [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens.1"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ]
    for path, body, status, param in refused:
        r = _post(base_url, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text


def test_vllm_s_constraints_hold_the_answer_on_every_path(url):
    """vLLM's guided_choice (structured_outputs.choice in its newer API), guided_grammar and
    allowed_token_ids, through every path: the answer is one of the choices, whole, the
    grammar's, or of the allowed tokens (unconstrained: "The capital of France is Paris.")."""
    answers = []
    for field in ({"guided_choice": ["Lyon", "Paris"]}, {"structured_outputs": {"choice": ["Lyon", "Paris"]}}):
        r = _post(url, CHAT, {"model": MODEL, "messages": QUESTION, "temperature": 0, **field})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answers.append((choice["message"]["content"], choice["finish_reason"]))
    assert answers[0] in {("Lyon", "stop"), ("Paris", "stop")} and answers[1] == answers[0]
    grammar = 'root ::= "It is " city "!"\ncity ::= "Lyon" | "Paris"'  # vLLM's guided_grammar, in GBNF
    r = _post(url, CHAT, {"model": MODEL, "messages": QUESTION, "temperature": 0, "guided_grammar": grammar})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in {"It is Lyon!", "It is Paris!"}
    # vLLM's allowed_token_ids: "Paris" (38634) and the end of the turn (2) are all it may write
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 4, "allowed_token_ids": [38634, 2]}
    r = _post(url, CHAT, body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("Paris") and content.replace("Paris", "") == ""


def test_min_p_1_samples_the_greedy_answer(url):
    """A hot sampled request with min_p 1 (the most likely token alone is left) and vLLM's
    top_k -1: the greedy answer, its first token sampled by prefill and the rest by decode."""
    body = {"model": MODEL, "messages": QUESTION, "temperature": 1.5, "seed": 3, "min_p": 1, "top_k": -1}
    r = _post(url, CHAT, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


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
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 5,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},  # 4 tokens: no full block to cache
    }


def test_n_choices_distinct_reproducible_and_usage_counted_once(url):
    body = {**TEXT, "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3}
    first, again = (_post(url, "/v1/completions", body) for _ in range(2))
    assert first.status_code == again.status_code == 200, first.text
    texts = [c["text"] for c in sorted(first.json()["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in first.json()["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3  # seed + i per choice: distinct samples
    assert texts == [c["text"] for c in sorted(again.json()["choices"], key=lambda c: c["index"])]
    usage = first.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 36)


def test_a_batch_of_prompts_answers_each_as_alone_streamed_or_not(url):
    """A batched completion (text and token ids, n=2): prompt i's choices at indexes 2i and
    2i+1, each the greedy answer of that prompt sent alone; each prompt counted once."""
    prompts = ["Once upon a time", [1000, 1001, 1002, 1003, 1004]]
    common = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [_post(url, COMPLETIONS, {**common, "prompt": prompt}).json() for prompt in prompts]
    batch = _post(url, COMPLETIONS, {**common, "prompt": prompts, "n": 2})
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [a["choices"][0]["text"] for a in alone for _ in range(2)]
    counts = {"prompt_tokens": sum(a["usage"]["prompt_tokens"] for a in alone), "completion_tokens": 24}
    assert {k: batch.json()["usage"][k] for k in counts} == counts
    stream_options = {"include_usage": True}
    streamed = _post(
        url, COMPLETIONS, {**common, "prompt": prompts, "n": 2, "stream": True, "stream_options": stream_options}
    )
    *events, done = _sse_events(streamed)
    assert done == "[DONE]"
    texts = ["", "", "", ""]
    for event in map(json.loads, events[:-1]):
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in choices]
    assert {k: json.loads(events[-1])["usage"][k] for k in counts} == counts


def test_a_prompt_whose_blocks_are_all_cached_on_decode_is_served(url):
    """Exactly two full blocks: asked twice, the decode replica holds both blocks and the
    transfer moves nothing (a byte counter once refused that); the prefill replica
    recomputes the last block (its last token's logits pick the first token)."""
    prompt = list(range(1000, 1032))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first, second = (_post(url, "/v1/completions", body) for _ in range(2))
    assert first.status_code == second.status_code == 200, second.text
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
TEXT = {"model": MODEL, "prompt": "Once upon a time"}
INPUT = {"model": MODEL, "input": "Once upon a time"}  # a response's
JSON_ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a person (name, age) as JSON."}]}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _tool(parameters: dict, name: str = "get_weather") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_and_penalties_across_paths(base_url):
    """Disaggregated, the first token (sampled under the grammar and the penalties on the
    prefill replica) is where the decode replica resumes: the same JSON as colocated."""
    body = {**JSON_ASK, "temperature": 0, "max_tokens": 40, "frequency_penalty": 0.5, "logit_bias": {"28": -5}}
    body["response_format"] = _json_schema(PERSON)
    contents = []
    with ThreadPoolExecutor(3) as pool:  # three applications: their replicas run side by side
        for r in pool.map(lambda path: _post(base_url + path, CHAT, body), ("", "/push", "/colo")):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            contents.append(r.json()["choices"][0]["message"]["content"])
    document = json.loads(contents[0])
    assert set(document) == {"name", "age"} and isinstance(document["age"], int)
    assert contents[1:] == contents[:1] * 2


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "text"),
    [
        (CHAT, "{not json", 400, None, "malformed JSON"),
        (CHAT, "[" * 100_000, 400, None, "malformed JSON"),
        (CHAT, '{"model": "' + MODEL + '", "seed": ' + "1" * 5000 + "}", 400, None, "malformed JSON"),
        (CHAT, "[1, 2]", 400, None, "must be a JSON object"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 10**9}, 400, "max_tokens", "beyond the context"),
        (
            CHAT,
            {"model": MODEL, "messages": QUESTION, "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
            "at least 1",
        ),
        (CHAT, {"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, "temperature", "temperature"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
        (
            CHAT,
            json.dumps({"model": MODEL, "messages": QUESTION, "temperature": float("nan")}),
            400,
            "temperature",
            "finite",
        ),
        (CHAT, {"model": MODEL, "messages": QUESTION, "top_p": 1.5}, 400, "top_p", "top_p"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "seed": 2**64}, 400, "seed", "seed"),
        (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", "messages"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1100}]}, 400, "messages", "1024"),
        (
            CHAT,
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages.0.content",
            "image_url",
        ),
        (CHAT, {"model": "gpt-9", "messages": QUESTION}, 404, "model", "gpt-9"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens", "min_"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "n": 17}, 400, "n", "less than or equal to 16"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "tools": [{"type": "function"}]}, 400, "tools.0.function", "req"),
        (CHAT, {"model": MODEL, "messages": QUESTION, "tool_choice": "auto"}, 400, "tool_choice", "needs tools"),
        (
            CHAT,
            {"model": MODEL, "messages": QUESTION, "tools": [_tool({"type": "string"})]},
            400,
            "tools.0.function.parameters",
            "type object",
        ),
        (
            CHAT,
            {"model": MODEL, "messages": [*QUESTION, {"role": "tool", "tool_call_id": "c9", "content": "1"}]},
            400,
            "messages.1.tool_call_id",
            "answers no earlier tool call",
        ),
        (CHAT, {"model": MODEL, "messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
        (COMPLETIONS, {**TEXT, "prompt": [1, 2, 10**6]}, 400, "prompt", "token id 1000000 is out of vocabulary"),
        (COMPLETIONS, {**TEXT, "prompt": ["a", [1, 10**6]]}, 400, "prompt.1", "prompt.1: token id 1000000 is out of"),
        (COMPLETIONS, {**TEXT, "prompt": ["a", [1, -1]]}, 400, "prompt.1", "prompt.1: token ids are non-negative"),
        (COMPLETIONS, {**TEXT, "prompt": ["a"] * 9, "n": 8}, 400, "prompt", "9 prompts x n=8 is over 64 choices"),
        (COMPLETIONS, {**TEXT, "prompt": []}, 400, "prompt", "empty"),
        (COMPLETIONS, json.dumps({**TEXT, "prompt": "a\ud800"}), 400, "prompt", "lone surrogate (\\ud800)"),
        (COMPLETIONS, b'{"model": "m", "prompt": "a\xed\xa0\x80"}', 400, None, "malformed JSON body: 'utf-8' codec"),
        (
            CHAT,
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\udc00"}]}),
            400,
            "messages.0.content",
            "not valid Unicode",
        ),
        (COMPLETIONS, {**TEXT, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        (COMPLETIONS, {**TEXT, "logprobs": 21}, 400, "logprobs", "logprobs"),
        (COMPLETIONS, {**TEXT, "echo": True, "max_tokens": -1}, 400, "max_tokens", "at least 0"),
        (COMPLETIONS, {**TEXT, "suffix": "The end."}, 400, "suffix", "not supported"),
        (CHAT, {**JSON_ASK, "guided_grammar": "root ::= x"}, 400, "guided_grammar", "Rule 'x' not found"),
        (CHAT, {**JSON_ASK, "bad_words": [" "]}, 400, "bad_words.0", "only white space"),
        (CHAT, {**JSON_ASK, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "when stream is true"),
        (COMPLETIONS, {**TEXT, "prompt_logprobs": -1}, 400, "prompt_logprobs", "greater than or equal to 0"),
        (COMPLETIONS, {**TEXT, "allowed_token_ids": [5, 49152]}, 400, "allowed_token_ids", "out of vocabulary"),
        (COMPLETIONS, {**TEXT, "allowed_token_ids": []}, 400, "allowed_token_ids", "at least 1 item"),
        (COMPLETIONS, {**TEXT, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "[1, 1024]"),
        (CHAT, {**JSON_ASK, "guided_regex": "(a"}, 400, "guided_regex", "unclosed group"),
        (COMPLETIONS, {**TEXT, "stop_token_ids": [49152]}, 400, "stop_token_ids", "out of vocabulary"),
        (COMPLETIONS, {**TEXT, "logit_bias": {"49152": 5}}, 400, "logit_bias", "out of vocabulary"),
        (COMPLETIONS, {**TEXT, "stop": ["1", "2", "3", "4", "5"]}, 400, "stop", "at most 4"),
        (CHAT, {**JSON_ASK, "response_format": _json_schema({"type": "foo"})}, 400, "response_format", "Invalid type"),
        (COMPLETIONS, {"prompt": "x"}, 400, "model", "model"),
        (RESPONSES, {**INPUT, "previous_response_id": "resp_1"}, 400, "previous_response_id", "not supported"),
        (RESPONSES, {**INPUT, "input": [{"type": "input_image"}]}, 400, "input.0", "not supported"),
        (RESPONSES, {**INPUT, "max_output_tokens": 10**6}, 400, "max_output_tokens", "max_model_len"),
        (RESPONSES, {**INPUT, "tools": [{"type": "web_search"}]}, 400, "tools.0.type", "'function'"),
        (RESPONSES, {**INPUT, "model": "other"}, 404, "model", "does not exist"),
    ],
)
def test_bad_input_gets_a_named_error(base_url, path, body, status, param, text):
    r = _post(base_url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert "Traceback" not in r.text
    ready = httpx.get(base_url + "/ready", timeout=30)  # the ingress is up, nothing left counted in flight
    assert ready.status_code == 200 and ready.json()["in_flight"] == 0, ready.text


def test_after_the_bad_inputs_the_app_that_refused_them_answers(base_url):
    ok = _post(base_url, COMPLETIONS, {**TEXT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_completion_logprobs_match_across_paths(base_url):
    """The first token's log-probabilities come from the prefill replica, the rest from decode."""
    body = {**TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    results = {}
    for prefix in ("", "/push", "/colo"):
        r = _post(base_url + prefix, COMPLETIONS, body)
        assert r.status_code == 200, r.text
        results[prefix] = r.json()["choices"][0]
    colo = results["/colo"]["logprobs"]
    assert "".join(colo["tokens"]) == results["/colo"]["text"] and len(colo["tokens"]) == 4
    for step, top in enumerate(colo["top_logprobs"]):  # greedy: the sampled token is the most likely
        assert len(top) == 2 and max(top.values()) == colo["token_logprobs"][step] <= 0
    for prefix in ("", "/push"):
        got = results[prefix]["logprobs"]
        assert got["tokens"] == colo["tokens"] and got["text_offset"] == colo["text_offset"]
        assert got["token_logprobs"] == pytest.approx(colo["token_logprobs"], abs=1e-3)
    for prefix in ("", "/push", "/colo"):  # ended at the first token: the prefill result's alone
        one = _post(base_url + prefix, COMPLETIONS, {**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
        assert one["tokens"] == colo["tokens"][:1]
        assert one["token_logprobs"] == pytest.approx(colo["token_logprobs"][:1], abs=1e-3)


def test_echo_gives_the_prompt_and_its_logprobs_the_same_on_every_path(base_url):
    """As lm-eval-harness scores a continuation: ``echo`` with ``logprobs``, the prompt's tokens
    first (the first one's null), then the output's; ``max_tokens`` 0: the prompt alone."""
    body = {**TEXT, "max_tokens": 2, "temperature": 0, "logprobs": 1}
    plain = _post(base_url + "/colo", COMPLETIONS, body).json()["choices"][0]
    num_prompt = _post(base_url, COMPLETIONS, body).json()["usage"]["prompt_tokens"]
    results = {}
    for prefix in ("", "/push", "/colo"):
        r = _post(base_url + prefix, COMPLETIONS, {**body, "echo": True})
        assert r.status_code == 200, r.text
        (choice,), usage = r.json()["choices"], r.json()["usage"]
        assert choice["text"] == TEXT["prompt"] + plain["text"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (num_prompt, 2)
        got = results[prefix] = choice["logprobs"]
        assert len(got["tokens"]) == num_prompt + 2 and "".join(got["tokens"]) == choice["text"]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert all(lp <= 0 for lp in got["token_logprobs"][1:])
        assert got["tokens"][num_prompt:] == plain["logprobs"]["tokens"]
        assert got["token_logprobs"][num_prompt:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-3)
    for prefix in ("", "/push"):
        assert results[prefix]["tokens"] == results["/colo"]["tokens"]
        assert results[prefix]["token_logprobs"][1:] == pytest.approx(results["/colo"]["token_logprobs"][1:], abs=1e-3)
    alone = _post(base_url, COMPLETIONS, {**body, "echo": True, "max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == TEXT["prompt"] and alone["choices"][0]["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == results["/colo"]["token_logprobs"][:num_prompt]


def test_vllms_prompt_logprobs_rank_each_prompt_token_as_the_echo_scores_it_on_every_path(base_url):
    """vLLM's ``prompt_logprobs``: per prompt token after the first a map from token id to its
    ``logprob``, ``rank`` and ``decoded_token``, the prompt's token first, then the alternatives;
    the same log-probabilities as an echo's; once on a chat's body."""
    body = {**TEXT, "max_tokens": 2, "temperature": 0}
    ids = _post(base_url, "/tokenize", {"prompt": TEXT["prompt"]}).json()["tokens"]
    echo = _post(base_url + "/colo", COMPLETIONS, {**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    expected = echo["logprobs"]["token_logprobs"][1 : len(ids)]
    for prefix in ("", "/push", "/colo"):
        r = _post(base_url + prefix, COMPLETIONS, {**body, "prompt_logprobs": 2, "n": 2})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            listed = choice["prompt_logprobs"]
            assert listed[0] is None and [next(iter(entry)) for entry in listed[1:]] == [str(i) for i in ids[1:]]
            own = [entry[str(token)] for entry, token in zip(listed[1:], ids[1:])]
            assert [e["logprob"] for e in own] == pytest.approx(expected, abs=1e-3)
            assert [e["decoded_token"] for e in own] == echo["logprobs"]["tokens"][1 : len(ids)]
            for entry in listed[1:]:  # the token's own rank, and the two most likely's, 1 and 2 (one may be it)
                ranks = sorted(e["rank"] for e in entry.values())
                assert ranks == [1, 2] if len(entry) == 2 else ranks[:2] == [1, 2] and ranks[2] >= 3
        assert r.json()["choices"][0]["text"] == echo["text"][len(TEXT["prompt"]) :]
    chat = _post(base_url, CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]


def test_echo_of_a_batch_of_token_prompts_streamed_or_not(base_url):
    prompts = [[504, 3458, 282, 4649, 314], [1076, 253, 725]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 0, "echo": True, "n": 2}
    whole = _post(base_url, COMPLETIONS, body).json()
    streamed = _sse_events(_post(base_url + "/push", COMPLETIONS, {**body, "stream": True}))
    chunks = [json.loads(e)["choices"][0] for e in streamed[:-1]]
    assert whole["usage"]["prompt_tokens"] == 8 and whole["usage"]["completion_tokens"] == 4
    for i in range(4):  # choices 0, 1 of the first prompt; 2, 3 of the second
        prompt, choice = prompts[i // 2], whole["choices"][i]
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1 and choice["logprobs"]["token_logprobs"][0] is None
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [t for c in mine for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
        assert [lp for c in mine for lp in c["logprobs"]["token_logprobs"]][1:] == pytest.approx(
            choice["logprobs"]["token_logprobs"][1:], abs=1e-3
        )


def test_chat_logprobs_streamed(url):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "logprobs": True, "top_logprobs": 1, "stream": True}
    r = _post(url, CHAT, body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(e) for e in _sse_events(r)[:-1]]
    content = [c for chunk in chunks[1:] for c in chunk["choices"][0]["logprobs"]["content"]]
    # 8 tokens, the last the end of the turn (its text is not in the message)
    assert "".join(c["token"] for c in content[:-1]) == "The capital of France is Paris."
    assert len(content) == 8 and all(len(c["top_logprobs"]) == 1 for c in content)


def test_requests_given_one_client_request_id_each_run_under_it(base_url):
    """Two requests with one ``X-Request-Id`` (a gateway retrying while the first still streams,
    or is still held on a replica): each runs, and answers under that id."""
    long = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
    headers = {"X-Request-Id": "same-0"}
    answer = lambda r: (r.status_code, r.headers.get_list("x-request-id"), r.json()["id"], r.json()["choices"])  # noqa: E731
    plain = _post(base_url, "/v1/chat/completions", short)  # no id given: the one Serve's proxy made up
    assert plain.headers.get_list("x-request-id") == [plain.json()["id"]]
    expected = plain.json()["choices"]
    text = lambda line: '"content":"' in line and '"content":""' not in line  # noqa: E731
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=long, headers=headers, timeout=60) as first:
        assert first.headers.get_list("x-request-id") == ["same-0"]
        lines = first.iter_lines()  # held: a collected iterator would close the stream
        next(line for line in lines if text(line))
        second = _post(base_url, "/v1/chat/completions", short, headers=headers)
        assert answer(second) == (200, ["same-0"], "same-0", expected), second.text
        # a batch's engine ids (its id, -<p>) would have been the first's: each engine id is its own
        batch = _post(
            base_url,
            "/v1/completions",
            {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2},
            {"X-Request-Id": "same"},
        )
        assert batch.status_code == 200 and len(batch.json()["choices"]) == 2, batch.text
        assert next(line for line in lines if text(line))  # the first request streams on
    # its client gone, the id serves again at once, while the first request may still be ending
    again = _post(base_url, "/v1/chat/completions", short, headers=headers)
    assert answer(again) == (200, ["same-0"], "same-0", expected), again.text
    # an id with spaces, colons and slashes (the KV hand-off's notices carry it, split at their first colon)
    odd = _post(base_url, "/v1/chat/completions", short, headers={"X-Request-Id": "job 7:a/-1"})
    assert answer(odd) == (200, ["job 7:a/-1"], "job 7:a/-1", expected), odd.text


def test_client_disconnect_frees_blocks_on_both_replicas(served):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", served.url("disagg") + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 10:
                break
    decode, prefill = wait_until(
        lambda: (_stats(served, "DecodeServer"), _stats(served, "PrefillServer")),
        20,
        "the decode and prefill replicas to free all their blocks",
        until=lambda both: all(s.num_free_blocks == s.num_total_blocks for s in both),
    )
    assert (decode.num_running, decode.num_free_blocks) == (0, decode.num_total_blocks)
    assert (prefill.num_pinned_blocks, prefill.num_free_blocks) == (0, prefill.num_total_blocks)


@pytest.mark.parametrize("path", ["", "/push"], ids=["pull", "push"])
def test_speculation_on_the_decode_side_gives_the_same_tokens_and_is_counted(base_url, path):
    """A completion that copies its prompt, through a disaggregated app (speculation on) and the
    colocated one (off): the same tokens; the decode replica's acceptance in ``/admin/kv``."""
    code = "def area(width, height):\n    return width * height\n\n"
    body = {"model": MODEL, "prompt": code * 3, "max_tokens": 40, "temperature": 0, "logprobs": 0}
    spec, plain = (_post(base_url + p, COMPLETIONS, body) for p in (path, "/colo"))
    assert spec.status_code == plain.status_code == 200, (spec.text, plain.text)
    assert spec.json()["choices"][0]["logprobs"]["tokens"] == plain.json()["choices"][0]["logprobs"]["tokens"]

    def decode_entry() -> dict | None:
        view = ok_json(httpx.get(base_url + path + "/admin/kv", timeout=30))
        entries = view["replicas"] if view is not None else []
        return next((e for e in entries if e["deployment"] == "DecodeServer" and e["live"]), None)

    # a report published mid-request may show drafts before any was accepted: wait for acceptance
    what = "the decode replica to publish its acceptance"
    entry = wait_until(
        decode_entry, 30, what, until=lambda e: e is not None and e["speculative"]["accepted_tokens"] > 0
    )
    counts = entry["speculative"]
    assert 0 < counts["accepted_tokens"] <= counts["draft_tokens"] and counts["acceptance_rate"] > 0


# ---- tool calls through the official openai client ----------------------------------------------
TOOLS = [
    _tool({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}, "get_weather"),
    _tool({"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}, "get_time"),
]  # fmt: skip
ASK_TOOLS = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]


def _openai(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed_calls(stream) -> tuple[list[tuple[str, str, str]], str | None]:
    """(id, name, arguments) of each streamed call, reassembled from its deltas; the finish reason."""
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = calls.setdefault(delta.index, [delta.id, delta.function.name, ""])
            entry[2] += delta.function.arguments or ""
        reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
    return [tuple(c) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", False), ("required", True), ({"type": "function", "function": {"name": "get_time"}}, True)],
    ids=["required", "required-parallel", "named"],
)
def test_forced_tool_calls_validate_against_their_schema_and_stream_as_they_answer(base_url, tool_choice, parallel):
    import jsonschema

    client, schemas = _openai(base_url), {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ask = dict(model=MODEL, messages=ASK_TOOLS, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, temperature=0)
    answer = client.chat.completions.create(**ask, parallel_tool_calls=parallel).choices[0]
    calls = answer.message.tool_calls
    assert answer.finish_reason == "tool_calls" and calls and answer.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert parallel or len(calls) == 1
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_time"]
    streamed, reason = _streamed_calls(client.chat.completions.create(**ask, parallel_tool_calls=parallel, stream=True))
    assert reason == "tool_calls" and all(i and i.startswith("call_") for i, _, _ in streamed)
    assert [(name, arguments) for _, name, arguments in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_tool_result_goes_back_and_the_answer_that_follows_is_text(base_url):
    client = _openai(base_url)
    ask = dict(model=MODEL, tools=TOOLS, max_tokens=48, temperature=0)
    first = client.chat.completions.create(**ask, messages=ASK_TOOLS, tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    [call] = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny; 21:00 in Tokyo"}
    history = [*ASK_TOOLS, message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(**ask, messages=history, tool_choice="none").choices[0]
    assert final.message.content and not final.message.tool_calls and final.finish_reason in ("stop", "length")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_framework_runs_a_tool_loop_against_the_server_unmodified(base_url, api):
    """openai-agents over chat completions or the Responses API (its default): the first turn
    forced (the default model is not trained for tools), the SDK's own reset of tool_choice after
    a call lets the next turn answer."""
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallOutputItem

    set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers: none here
    ran: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        ran.append(city)
        return f"18 C and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        tools=[get_weather],
        model=(OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
            model=MODEL, openai_client=client
        ),
        model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    kinds = [type(item) for item in result.new_items]
    assert len(ran) == 1 and ToolCallOutputItem in kinds
    assert kinds.index(ToolCallOutputItem) < len(kinds) - 1 and kinds[-1] is MessageOutputItem
    assert isinstance(result.final_output, str) and result.final_output.strip()


# ---- the Responses API through the official openai client and an agent framework ----------------
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_the_responses_api_answers_as_the_chat_does_streamed_or_not(base_url):
    client = _openai(base_url)
    ask = dict(model=MODEL, instructions="Answer briefly.", input=QUESTION[0]["content"], max_output_tokens=12,
               temperature=0)  # fmt: skip
    system = {"role": "system", "content": "Answer briefly."}
    chat = client.chat.completions.create(model=MODEL, messages=[system, *QUESTION], max_tokens=12, temperature=0)
    response = client.responses.create(**ask, metadata={"run": "1"})
    assert response.output_text == chat.choices[0].message.content and response.object == "response"
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.metadata == {"run": "1"} and response.store is False
    events = list(client.responses.create(**ask, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].type == f"response.{response.status}" and events[-1].response.output_text == response.output_text
    missing = httpx.get(f"{base_url}/v1/responses/{response.id}", timeout=30)
    assert missing.status_code == 404 and "does not store" in missing.json()["error"]["message"]


def test_the_responses_api_runs_a_tool_loop_streamed_or_not(base_url):
    import jsonschema

    client, schemas = _openai(base_url), {t["name"]: t["parameters"] for t in RESPONSE_TOOLS}
    ask = dict(model=MODEL, input=ASK_TOOLS[0]["content"], tools=RESPONSE_TOOLS, tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=48, temperature=0)  # fmt: skip
    first = client.responses.create(**ask)
    [call] = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    events = list(client.responses.create(**ask, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments and events[-1].response.output[0].name == call.name
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny; 21:00 in Tokyo"}
    history = [{"role": "user", "content": ASK_TOOLS[0]["content"]}, call.model_dump(exclude_none=True), result]
    final = client.responses.create(**{**ask, "input": history, "tool_choice": "none"})
    assert final.output_text.strip() and [item.type for item in final.output] == ["message"]


def test_a_required_call_is_the_same_on_every_path(url, base_url):
    """Prefill's first token under the grammar, decode's rest under it after the hand-off (pull or
    push), or both on one colocated replica: the same greedy call."""
    ask = dict(model=MODEL, messages=ASK_TOOLS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_tokens=48, temperature=0)  # fmt: skip
    import jsonschema

    calls = [_openai(u).chat.completions.create(**ask).choices[0].message.tool_calls for u in (url, base_url)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    [call] = calls[0]  # one call (parallel_tool_calls false), valid on this path
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert [(c.function.name, c.function.arguments) for c in calls[0]] == [
        (c.function.name, c.function.arguments) for c in calls[1]
    ]


def test_a_schema_s_unbounded_numbers_cannot_run_to_the_length_limit(base_url):
    """An integer and a number with no bounds of their own, 48 tokens: the answer ends (stop) and
    parses, its numbers within what a JSON reader holds."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
              "population": {"type": "integer"}, "area": {"type": "number"}},
              "required": ["city", "population", "area"], "additionalProperties": False}  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Paris as JSON: its population and area."}],
            "max_tokens": 48, "temperature": 0, "response_format": _json_schema(schema)}  # fmt: skip
    choice = _post(base_url, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    answer = json.loads(choice["message"]["content"])
    assert abs(answer["population"]) <= 2**53 - 1 and abs(answer["area"]) <= 2**53 - 1
    written = re.search(r'"area": (-?\d+)(\.\d+)?[,}]', choice["message"]["content"])  # no exponent
    assert written is not None and len((written.group(2) or ".")[1:]) <= 9, choice["message"]["content"]
