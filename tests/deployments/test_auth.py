"""API keys on the served app (``auth``): 401 without a key or with a wrong one, on every
``/v1/*`` and ``/admin/*`` route; the right key (from the key file, or inline) works through
the official ``openai`` client; probes and the schema stay open; and no key reaches a log."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import ray

from deployments.auth import ApiKeys, bearer_token
from tests.deployments.keyed_app import FILE_KEY, INLINE_KEY
from tests.tiny_models import TINY_SERVED_NAME

MODEL = TINY_SERVED_NAME
WRONG_KEY = "sk-tandem-wrong-99aa11bb33"
MESSAGES = [{"role": "user", "content": "Say hello."}]
PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/admin/autoscaler"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/no-such-route"),  # 401 before routing: no route listing for clients without a key
]


def test_keys_match_by_index_and_headers_parse_as_bearer_only():
    keys = ApiKeys([FILE_KEY, INLINE_KEY])
    assert keys.match(FILE_KEY.encode()) == 0 and keys.match(INLINE_KEY.encode()) == 1
    assert keys.match(WRONG_KEY.encode()) is None and keys.match(FILE_KEY[:-1].encode()) is None
    assert bearer_token([(b"authorization", b"bearer  " + FILE_KEY.encode())]) == FILE_KEY.encode()
    assert bearer_token([(b"authorization", b"Basic " + FILE_KEY.encode())]) is None
    assert bearer_token([(b"authorization", b"Bearer")]) is None and bearer_token([]) is None


@pytest.fixture(scope="module")
def url(keyed_url: str) -> str:
    return keyed_url


def _request(url: str, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": MODEL, "messages": MESSAGES, "prompt": "Hi", "max_tokens": 1} if method == "POST" else None
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("key", [None, WRONG_KEY])
def test_v1_and_admin_refuse_a_missing_or_wrong_key(url, key):
    for method, path in PROTECTED:
        response = _request(url, method, path, key)
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"
        message = (
            "Missing API key: send it as 'Authorization: Bearer <key>'."
            if key is None
            else ("Incorrect API key provided.")
        )
        assert response.json() == {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        }
        assert key is None or key not in response.text


def test_probes_and_schema_are_open_admin_takes_the_key(url):
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(url + "/ready", timeout=10).status_code == 200
    schema = httpx.get(url + "/openapi.json", timeout=10).json()
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "one of the server's auth.api_keys",
    }
    assert schema["paths"]["/v1/chat/completions"]["post"]["security"] == [{"apiKey": []}]
    assert "security" not in schema["paths"]["/health"]["get"]
    admin = _request(url, "GET", "/admin/autoscaler", INLINE_KEY)
    assert admin.status_code == 200 and admin.json()["enabled"] is False


def test_the_openai_client_with_a_right_key_is_served_and_with_a_wrong_one_refused(url):
    for key in (FILE_KEY, INLINE_KEY):
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == 2
        assert [m.id for m in client.models.list().data] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("no-such-model")
        assert missing.value.code == "model_not_found"
        batch = client.completions.create(
            model=MODEL, prompt=["Hi", "Bye"], max_tokens=2, n=2, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.completion_tokens == 8
        scored = client.completions.create(model=MODEL, prompt="The sky is blue", max_tokens=0, echo=True, logprobs=0)
        (choice,) = scored.choices
        assert choice.text == "The sky is blue" and scored.usage.completion_tokens == 0
        assert len(choice.logprobs.tokens) == scored.usage.prompt_tokens and choice.logprobs.token_logprobs[0] is None
    client = openai.OpenAI(base_url=url + "/v1", api_key=WRONG_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_no_key_in_any_log_line(url):
    """Last in this module, after every request above: the whole Ray session's logs (driver,
    Serve controller, proxy, replicas) hold the requests' access lines but no key, right or wrong."""
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    texts = [path.read_bytes() for path in logs_dir.rglob("*") if path.is_file()]
    assert any(b"/v1/chat/completions" in text for text in texts)  # the requests were logged
    for key in (FILE_KEY, INLINE_KEY, WRONG_KEY):
        assert not any(key.encode() in text for text in texts), key
