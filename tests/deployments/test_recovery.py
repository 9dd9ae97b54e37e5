"""Failures rehearsed through the served application (``faults:`` in its config), real Ray and NIXL.

Two applications of the tiny served model (tests/tiny_models.py: a wrong KV block changes its
tokens), 1 prefill + 1 decode replica each, ``kv_transfer_timeout_s=10``: pull at ``/`` and
push at ``/push``. The faults select requests by id prefix (``X-Request-Id``), so
every test triggers its own: a prefill replica killed (SIGKILL) during a transfer, the decode
replica killed mid-stream, transfers failing for 5% of requests, a dropped release notice and
a stalled fetch (both end at the KV lease); and, on a busy colocated app of the default model
(whose long request outlasts the bound), a request left without output past the stream idle
bound.
Requests with no token sent yet complete with the engine's output (tests/same_output.py's
rule); a stream that had tokens ends with an error event, not left hanging (within
``peer_check_interval_s`` + 30 s of the kill, far below the client's 120 s); the service
answers again after the restart; afterwards ``GET /admin/kv`` shows every live replica's
invariants holding and no block held.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from app.config import colocated_app, disagg_app
from app.settings import AppConfig
from engine.loader import DEFAULT_MODEL_NAME
from engine.params import unique_request_id
from kv_transport.faults import FaultPoints
from tests.same_output import MIN_COMPARED_TOKENS, GreedyTrace, assert_same_output, engine_text_traces
from tests.serving import ServeApp
from tests.tiny_models import TINY_SERVED_NAME
from tests.waiting import ok_json, wait_until, wait_until_async

ROOT = "/recovery"  # this module's applications: pull here, push and busy below
BUSY = "/busy"
NUM_TOKENS = MIN_COMPARED_TOKENS
TIMEOUT_S = 10.0
PEER_CHECK_S = 5.0
ERROR_DEADLINE_S = PEER_CHECK_S + 30.0  # a slack no busy machine exceeds, far below the client timeout
PROMPTS = (
    "Write a long story about a lighthouse keeper.",
    "Explain how a steam engine works, step by step.",
    "List the planets of the solar system and describe each one.",
)
PROMPT_IDS: list[list[int]] = []  # filled by the reference fixture
PULL_FAULTS = [
    {"point": "after_export", "action": "crash", "request_id_prefix": "kill-prefill-"},
    {"point": "fetch", "action": "delay", "seconds": 1.0, "request_id_prefix": "kill-prefill-"},
    {"point": "mid_decode", "action": "crash", "request_id_prefix": "kill-decode-", "after_tokens": 8},
    {"point": "fetch", "action": "fail", "probability": 0.05},
    {"point": "release", "action": "drop", "request_id_prefix": "drop-"},
    # past the lease by 4 s: the producer's expiry round, not the stalled consumer's give-back, frees it
    {"point": "fetch", "action": "delay", "seconds": TIMEOUT_S + 4, "request_id_prefix": "stall-"},
]
PUSH_FAULTS = [
    {"point": "push_layer", "action": "crash", "layer": 4, "request_id_prefix": "kill-prefill-"},
    {"point": "after_push", "action": "crash", "request_id_prefix": "kill-after-push-"},
    {"point": "push_layer", "action": "fail", "probability": 0.05},
]
COMMON = {
    "model.max_model_len": "512",
    "engine.kv_cache_bytes": str(64 << 20),
    "prefill.num_cpus": "0.25",
    "decode.num_cpus": "0.25",
    "autoscaling.enabled": "false",
    "transport.kv_transfer_timeout_s": str(TIMEOUT_S),
    "transport.peer_check_interval_s": str(PEER_CHECK_S),
}
PULL_ARGS = {**COMMON, "faults": json.dumps(PULL_FAULTS)}
PUSH_ARGS = {**COMMON, "transport.mode": "push", "faults": json.dumps(PUSH_FAULTS)}
IDLE_S = 4.0
BUSY_CONTEXT = 2048
BUSY_ARGS = {  # one sequence at a time: a second request waits with no output
    "model.max_model_len": str(BUSY_CONTEXT),
    "engine.kv_cache_bytes": str(128 << 20),  # one whole context (46 KB a token)
    "engine.max_num_seqs": "1",
    "colocated.num_replicas": "1",
    "colocated.num_cpus": "0.25",
    "limits.stream_idle_timeout_s": str(IDLE_S),
}


@pytest.fixture(scope="module")
def reference(tiny_served) -> list[GreedyTrace]:
    """The engine alone, the prompts in one batch, as the tokens' texts (what the API returns);
    the prompts' token ids go in ``PROMPT_IDS`` (what the requests send)."""
    loaded = tiny_served.loaded
    PROMPT_IDS[:] = [loaded.tokenizer(prompt).input_ids for prompt in PROMPTS]
    return engine_text_traces(loaded, PROMPT_IDS, NUM_TOKENS)


@pytest.fixture(scope="module")
def base_url(shared_serve, tiny_served) -> Iterator[str]:
    apps = [
        ServeApp("recovery-pull", disagg_app, {**PULL_ARGS, **tiny_served.args}, route_prefix=ROOT),
        ServeApp("recovery-push", disagg_app, {**PUSH_ARGS, **tiny_served.args}, route_prefix=f"{ROOT}/push"),
        ServeApp("recovery-busy", colocated_app, BUSY_ARGS, route_prefix=ROOT + BUSY),
    ]
    with shared_serve.apps(apps) as served:
        yield served.url("recovery-pull")


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    status: int
    tokens: list[str] = field(default_factory=list)
    top: list[tuple[str, ...]] = field(default_factory=list)
    error: dict | None = None
    done: bool = False
    last_token_at: float | None = None
    error_at: float | None = None
    body: str = ""

    def trace(self) -> GreedyTrace:
        return GreedyTrace(tuple(self.tokens), tuple(self.top))


def _model(path: str) -> str:
    """The busy app serves the default model (a long request outlasts the idle bound); the
    pull and push apps the tiny one."""
    return DEFAULT_MODEL_NAME if path == BUSY else TINY_SERVED_NAME


async def _stream(client: httpx.AsyncClient, path: str, request_id: str, prompt: int, delay_s: float = 0) -> Streamed:
    await asyncio.sleep(delay_s)
    body = {
        "model": _model(path),
        "prompt": PROMPT_IDS[prompt],
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "stream": True,
    }
    headers = {"X-Request-Id": request_id}
    async with client.stream("POST", path + "/v1/completions", json=body, headers=headers) as response:
        result = Streamed(response.status_code)
        if response.status_code != 200:
            result.body = (await response.aread()).decode()
            return result
        async for line in response.aiter_lines():
            _take(result, line)
    return result


def _take(result: Streamed, line: str) -> None:
    if not line.startswith("data: "):
        return
    data = line[len("data: ") :]
    if data == "[DONE]":
        result.done = True
        return
    event = json.loads(data)
    if "error" in event:
        result.error, result.error_at = event["error"], time.monotonic()
        return
    for choice in event["choices"]:
        logprobs = choice.get("logprobs") or {}
        result.tokens += logprobs.get("tokens", [])
        result.top += [tuple(t) for t in logprobs.get("top_logprobs", [])]
        if logprobs.get("tokens"):
            result.last_token_at = time.monotonic()


def _run(path: str, requests: list[tuple[str, int, float]], base_url: str) -> list[Streamed]:
    async def main() -> list[Streamed]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, path, *r) for r in requests))

    return asyncio.run(main())


def _kv(base_url: str, path: str) -> dict:
    response = httpx.get(f"{base_url}{path}/admin/kv", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _kv_or_none(base_url: str, path: str) -> dict | None:
    """For waits: the view, or None while the store it is read from is away (503)."""
    return ok_json(httpx.get(f"{base_url}{path}/admin/kv", timeout=30))


def _live(view: dict | None, deployment: str) -> list[dict]:
    return [r for r in view["replicas"] if r["live"] and r["deployment"] == deployment] if view is not None else []


def _assert_nothing_held(base_url: str, path: str) -> None:
    """Every live replica: invariants hold, and (once leases ran out) no block is held."""

    def settled() -> bool:
        view = _kv_or_none(base_url, path)
        if view is None:
            return False
        live = [r for r in view["replicas"] if r["live"]]
        held = sum(r["num_in_use_blocks"] + r["num_pinned_blocks"] + r["num_reserved_blocks"] for r in live)
        return view["ok"] and held == 0 and {r["deployment"] for r in live} == {"PrefillServer", "DecodeServer"}

    wait_until(settled, TIMEOUT_S + 10, f"{path or '/'}: every live replica idle with its invariants holding")
    for replica in _kv(base_url, path)["replicas"]:
        if replica["live"]:
            assert replica["problems"] == [] and replica["ok"], replica
            assert replica["num_free_blocks"] + replica["num_cached_blocks"] == replica["num_total_blocks"], replica


def _assert_same(results: list[Streamed], prompts: list[int], reference: list[GreedyTrace]) -> None:
    for result, prompt in zip(results, prompts):
        assert result.status == 200 and result.error is None and result.done, result
        assert_same_output(reference[prompt], result.trace(), exact=False, label=f"prompt {prompt}")


def _drawn(faults: list[dict], point: str, count: int, prefix: str) -> list[str]:
    """Request ids whose 5% draw hits ``point``'s failure (the rule is deterministic per id)."""
    points = FaultPoints(AppConfig.model_validate({"faults": faults}).faults)
    ids = (f"{prefix}{i}" for i in range(10_000))
    served = ((rid, unique_request_id(rid)) for rid in ids)  # the engines draw on the id the ingress gives
    return [rid for rid, engine_id in served if any(r.action == "fail" for _, r in points.selected(point, engine_id))][
        :count
    ]


def _engine_ids(view: dict | None, deployment: str) -> set[str]:
    return {r["engine_id"] for r in _live(view, deployment)}


def _restarted(base_url: str, path: str, deployment: str, before: set[str]) -> None:
    def replaced() -> bool:
        now = _engine_ids(_kv_or_none(base_url, path), deployment)
        return bool(now) and not now & before

    wait_until(replaced, 300, f"{deployment} of {path or '/'} restarted")


@pytest.mark.parametrize("path", ["", "/push"], ids=["pull", "push"])
def test_prefill_killed_during_transfer_requests_complete(base_url, reference, path):
    """The prefill replica dies (SIGKILL) during a request's transfer, with others in flight
    there: none had a token yet, so each is retried (prefilled on the decode replica) and
    completes with the engine's output; the replica restarts and serves again."""
    _assert_nothing_held(base_url, path)
    before = _engine_ids(_kv(base_url, path), "PrefillServer")
    requests = [("kill-prefill-1", 0, 0.0)] + [(f"{path}-inflight-{i}", i % 3, 0.05 * i) for i in range(1, 6)]
    results = _run(path, requests, base_url)
    _assert_same(results, [r[1] for r in requests], reference)
    _restarted(base_url, path, "PrefillServer", before)
    (again,) = _run(path, [(f"{path}-after-restart", 1, 0.0)], base_url)
    _assert_same([again], [1], reference)
    _assert_nothing_held(base_url, path)


def test_prefill_killed_after_its_push_the_stream_completes(base_url, reference):
    """The prefill replica dies after a push completed (its completion notice sent) and before
    its call's reply: the decode replica holds the whole KV and streams, so the request
    completes with the engine's output, not with an error; the replica restarts."""
    _assert_nothing_held(base_url, "/push")
    before = _engine_ids(_kv(base_url, "/push"), "PrefillServer")
    (result,) = _run("/push", [("kill-after-push-1", 0, 0.0)], base_url)
    _assert_same([result], [0], reference)
    _restarted(base_url, "/push", "PrefillServer", before)
    _assert_nothing_held(base_url, "/push")


def test_decode_killed_mid_stream(base_url, reference):
    """The decode replica dies after a stream's 8th token. Streams the ingress had passed an
    output of end with an error event (then ``[DONE]``): within ``ERROR_DEADLINE_S``
    of the last token when their decode call was on the killed replica, at the KV's lease when
    it was queued for the restarted one (pull sends the prefill's first token at once); a
    request with no output yet is retried on the restarted replica (or, a stream being
    answered already, ends with an error event once ``recovery.wait_s`` passed with no replica
    back); afterwards the service answers with the engine's output."""
    _assert_nothing_held(base_url, "")
    before = _engine_ids(_kv(base_url, ""), "DecodeServer")
    requests = [("kill-decode-1", 0, 0.0), ("decode-peer-1", 1, 0.0), ("decode-peer-2", 2, 0.2)]
    results = _run("", requests, base_url)
    # The replica died after producing the killed request's 8th token; what was still on its
    # way died with it, so a client may have seen none of a request's tokens.
    assert results[0].error is None or len(results[0].tokens) <= 8, results[0]
    seen = [r.last_token_at for r in results if r.error is not None and r.last_token_at is not None]
    for result, (_, prompt, _) in zip(results, requests):
        if result.error is not None:  # an output had left the ingress: an error event
            assert result.status == 200 and result.done and result.error["type"] == "server_error", result
            if "gone" in result.error["message"]:  # its decode call was on the killed replica: in time
                assert not seen or result.error_at - max(seen) <= ERROR_DEADLINE_S, result
            elif "no replica could take the request" in result.error["message"]:  # retried, no replica back
                assert not result.tokens and "retry later" in result.error["message"], result
            else:  # its first token came from prefill, then its decode call waited in Serve for the
                # restarted replica, which found the KV's lease over: the transfer's own error
                assert result.error["code"] == "kv_transfer_failed" and "lease" in result.error["message"], result
        else:  # no output yet: retried on the restarted replica
            _assert_same([result], [prompt], reference)
    _restarted(base_url, "", "DecodeServer", before)
    (again,) = _run("", [("after-decode-restart", 2, 0.0)], base_url)
    _assert_same([again], [2], reference)
    _assert_nothing_held(base_url, "")


@pytest.mark.parametrize(("path", "point"), [("", "fetch"), ("/push", "push_layer")], ids=["pull", "push"])
def test_five_percent_of_transfers_fail_and_every_request_completes(base_url, reference, path, point):
    faults = PULL_FAULTS if path == "" else PUSH_FAULTS
    failing = _drawn(faults, point, 2, f"{path}-five-")
    requests = [(rid, i % 3, 0.1 * i) for i, rid in enumerate(failing + [f"{path}-ok-{i}" for i in range(3)])]
    results = _run(path, requests, base_url)
    _assert_same(results, [r[1] for r in requests], reference)
    _assert_nothing_held(base_url, path)


def _expired_exports(base_url: str, path: str) -> int:
    """The live prefill replica's count of exports freed at their lease's end (since it started),
    read once it shows as live (its last published state recent)."""
    read = lambda: _live(_kv_or_none(base_url, path), "PrefillServer")  # noqa: E731
    (prefill,) = wait_until(read, TIMEOUT_S, "the prefill replica live in /admin/kv", until=lambda live: len(live) == 1)
    return prefill["expired_exports"]


def test_dropped_release_and_stalled_fetch_end_at_the_lease(base_url, reference):
    """A dropped release notice leaves the producer's blocks pinned until the lease (10 s)
    ends, then they are freed; a fetch stalled past the lease is refused (the blocks may have
    been reused: never read) and the request is retried, completing with the engine's output.
    Both exports end at their lease, neither earlier: the prefill replica counts exactly two
    more expired (an export freed any other way is not counted)."""
    _assert_nothing_held(base_url, "")
    before = _expired_exports(base_url, "")

    async def main() -> list[Streamed]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(_stream(client, "", "drop-1", 0), _stream(client, "", "stall-1", 1))

    results = asyncio.run(main())
    _assert_same(results, [0, 1], reference)
    _assert_nothing_held(base_url, "")  # both freed at their lease's end
    assert _expired_exports(base_url, "") == before + 2  # read after: the count comes before the blocks' release


def test_a_stream_idle_past_its_bound_is_aborted_and_frees_its_blocks(base_url, reference):
    """A replica that runs one sequence at a time, busy with a long one (up to its whole
    context: far more tokens than any CPU makes within the bound): a second request gets no
    output past ``limits.stream_idle_timeout_s`` (4 s), is aborted with an error event (code
    ``timeout``) and frees its blocks; the long one streams on, and once its client hangs up it
    is aborted too, so the replica ends with nothing held."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT_IDS[0], "max_tokens": BUSY_CONTEXT - len(PROMPT_IDS[0]),
            "ignore_eos": True, "logprobs": 1, "stream": True}  # fmt: skip

    async def main() -> tuple[Streamed, int, Streamed]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            # a warm replica: the long request's first token comes well within the idle bound (a
            # first answer slower than the bound, on a stalled machine, is a 504: asked again)
            warm = {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT_IDS[0], "max_tokens": 2}

            async def warm_status() -> int:
                return (await client.post(BUSY + "/v1/completions", json=warm)).status_code

            status = await wait_until_async(warm_status, 120, "an answer other than 504", until=lambda s: s != 504)
            assert status == 200, status
            headers = {"X-Request-Id": "busy-long"}
            async with client.stream("POST", BUSY + "/v1/completions", json=body, headers=headers) as response:
                long = Streamed(response.status_code)

                async def read() -> None:  # as the tokens come: none waits in a buffer
                    async for line in response.aiter_lines():
                        _take(long, line)

                reader = asyncio.ensure_future(read())
                try:
                    await wait_until_async(lambda: long.tokens or reader.done(), 120, "the long request's first token")
                    assert long.error is None and not reader.done(), long  # it streams while the other waits
                    waiting = await _stream(client, BUSY, "busy-idle", 0)
                    before = len(long.tokens)
                    await wait_until_async(lambda: len(long.tokens) >= before + 8 or reader.done(), 60,
                                           "8 more tokens of the long request")  # fmt: skip
                finally:
                    reader.cancel()
            return long, before, waiting  # the stream closed under the long request: its client hung up

    long, before, idle = asyncio.run(main())
    assert long.status == 200 and long.error is None and len(long.tokens) >= before + 8, long
    assert idle.status == 200 and idle.tokens == [] and idle.done, idle
    assert idle.error["code"] == "timeout" and "limits.stream_idle_timeout_s" in idle.error["message"], idle.error

    def idle_replica() -> bool:
        live = _live(_kv_or_none(base_url, BUSY), "ColocatedServer")  # none while its report is late
        return len(live) == 1 and live[0]["ok"] and live[0]["num_in_use_blocks"] == 0 and live[0]["num_requests"] == 0

    wait_until(idle_replica, 30, "the busy replica idle, nothing held")
