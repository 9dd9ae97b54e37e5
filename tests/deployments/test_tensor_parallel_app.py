"""``disagg_app`` of the tiny served model (tests/tiny_models.py) with a tensor-parallel prefill
pool (3 ranks, its 3 KV heads one per rank, as the default model's would be) and a one-rank
decode pool, pull: each request's KV is read head by head from the three prefill ranks
(``kv_transport.sharded``). Through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.same_output import GreedyTrace, assert_same_output, engine_text_traces
from tests.serving import ServeApp
from tests.tiny_models import TINY_SERVED_NAME
from tests.waiting import wait_until

ROOT = "/tp"
PROMPTS = [
    "The three primary colors are",
    "Write a short poem about the sea. The sea",
    "In 1969, the first humans landed on the Moon. The mission was",
]
NUM_TOKENS = 96  # long enough that the killed rank finds requests in flight
SETTLE_S = 90.0  # a replaced group starts (three ranks load the model) and leases run out
ARGS = {
    "model.max_model_len": "512",
    "engine.kv_cache_bytes": str(32 << 20),
    "prefill.num_cpus": "0.25",
    "prefill.tensor_parallel_size": "3",
    "decode.num_cpus": "0.25",
    "autoscaling.enabled": "false",
    "transport.kv_transfer_timeout_s": "20",
}


@pytest.fixture(scope="module")
def reference(tiny_served) -> list[GreedyTrace]:
    """One engine of one rank in this process, the prompts in one batch, as the tokens' texts
    (the engine, not ``generate``: with ``ignore_eos`` it keeps EOS among the candidates, as
    the served engine does, where ``min_new_tokens`` would mask it)."""
    loaded = tiny_served.loaded
    return engine_text_traces(loaded, [loaded.tokenizer(p).input_ids for p in PROMPTS], NUM_TOKENS)


@pytest.fixture(scope="module")
def base_url(shared_serve, tiny_served) -> Iterator[str]:
    from app.config import disagg_app

    with shared_serve.apps([ServeApp("tp", disagg_app, {**ARGS, **tiny_served.args}, route_prefix=ROOT)]) as served:
        yield served.url("tp")


def _kv(base_url: str) -> dict:
    return httpx.get(base_url + "/admin/kv", timeout=30).json()


def _live(base_url: str, deployment: str) -> list[dict]:
    return [r for r in _kv(base_url)["replicas"] if r["live"] and r["deployment"] == deployment]


def _the_replica(base_url: str, deployment: str) -> dict:
    """The deployment's one live replica, once it has published its state."""
    (replica,) = wait_until(lambda: _live(base_url, deployment), SETTLE_S, f"{deployment} published", until=len)
    return replica


def _complete(base_url: str, prompt: int, request_id: str) -> GreedyTrace:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.completions.create(
        model=TINY_SERVED_NAME,
        prompt=PROMPTS[prompt],
        max_tokens=NUM_TOKENS,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
    )
    logprobs = answer.choices[0].logprobs
    top = tuple(tuple(sorted(t, key=t.get, reverse=True)) for t in logprobs.top_logprobs)
    return GreedyTrace(tuple(logprobs.tokens), top)


def _assert_nothing_held(base_url: str) -> None:
    def settled() -> bool:
        view = _kv(base_url)
        live = [r for r in view["replicas"] if r["live"]]
        held = sum(r["num_in_use_blocks"] + r["num_pinned_blocks"] + r["num_reserved_blocks"] for r in live)
        return view["ok"] and held == 0 and {r["deployment"] for r in live} == {"PrefillServer", "DecodeServer"}

    wait_until(settled, SETTLE_S, "every live replica idle with its invariants holding")


def test_greedy_tokens_through_three_prefill_ranks(base_url, reference):
    prefill = _the_replica(base_url, "PrefillServer")
    assert [r["kv_heads"] for r in prefill["ranks"]] == [[0, 1], [1, 1], [2, 1]]
    assert len({r["pid"] for r in prefill["ranks"]}) == 3
    for i in range(len(PROMPTS)):
        assert_same_output(reference[i], _complete(base_url, i, f"tp-{i}"), exact=False, label=f"prompt {i}")
    _assert_nothing_held(base_url)


def test_a_killed_rank_fails_the_replica_and_serve_replaces_the_group(base_url, reference):
    """SIGKILL of prefill rank 2 with requests in flight: those without a token yet are retried
    (prefilled on the decode replica), each completes with transformers' tokens; the replica's
    health check fails, Serve replaces all three ranks, and nothing is left held."""
    prefill = _the_replica(base_url, "PrefillServer")
    pids = [r["pid"] for r in prefill["ranks"]]

    async def run() -> list[GreedyTrace]:
        calls = [asyncio.to_thread(_complete, base_url, i % 3, f"tp-kill-{i}") for i in range(4)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0.2)
        os.kill(pids[2], signal.SIGKILL)  # a rank this test's app started
        return await asyncio.gather(*tasks)

    for i, trace in enumerate(asyncio.run(run())):
        assert_same_output(reference[i % 3], trace, exact=False, label=f"request {i}")

    def replaced() -> bool:
        now = _live(base_url, "PrefillServer")
        return len(now) == 1 and now[0]["engine_id"] != prefill["engine_id"]

    wait_until(replaced, SETTLE_S * 3, "the prefill replica replaced")
    again = _the_replica(base_url, "PrefillServer")
    assert not {r["pid"] for r in again["ranks"]} & set(pids)  # every rank new
    assert_same_output(reference[1], _complete(base_url, 1, "tp-after"), exact=False, label="after the restart")
    _assert_nothing_held(base_url)
