"""Replica scaling on a real local app (1 prefill + 1 decode to start, fractional CPUs).

A sustained decode-heavy load makes the controller raise the decode pool's target; the
decode replicas relay it to Serve, whose policy function follows it, and a second decode
replica starts and reports. The load then falls to a few long requests, each client sending
its next one as soon as the last ends, until the pool has shrunk: the target falls back to
1 and Serve stops one replica while long requests are in flight by construction. Every
request completes with the same greedy output as the engine alone (tests/same_output.py's
rule): Serve drains the stopped replica, then its ``__del__`` keeps exported KV until
fetched, then closes its KV transport, whose peer-registry entry goes with it. Where Serve's
router places each request is not asserted (it depends on timing). Lending is off in this
policy (``max_lent: 0``) so only the replica count moves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from app.config import disagg_app
from kv_transport.registry import RayPeerRegistry
from tests.same_output import MIN_COMPARED_TOKENS, GreedyTrace, assert_same_output, engine_text_traces
from tests.serving import ServeApp
from tests.waiting import ok_json, wait_until, wait_until_async

LONG_TOKENS = 64
SHORT_TOKENS = 24
# 6 streams kept in flight by the load need 2 decode replicas at 3 each as soon as 4 of them
# decode at once (each request also spends time queued and in prefill: at 5 each, all 6 had
# to decode at every decision for the whole delay, so when the scale-up came was chance); the
# 2 long requests after it (2 <= 0.9 * 3 on one replica) are the surplus that scales back down
NUM_LOAD = 6
SHORT_PROMPT = "Write a long story about a lighthouse keeper and the ships that pass."
LONG_PROMPTS = (  # distinct from their first token: no prefix keeps them on one replica
    "Tell a long tale of a baker who wakes before dawn in a mountain village.",
    "Describe, at length, a train journey across a desert at night.",
)
POLICY = """
slo: {ttft_p90_ms: 5000, tpot_p90_ms: 500}
interval_s: 0.5
cooldown_s: 5
window_s: 10
min_samples: 5
stale_after_s: 5
max_lent: 0                      # no lending: only replica counts move here
decode_pressure: {running_per_replica: {enter: 100, leave: 50}}
prompt_placement: {enabled: false}
scaling:
  enabled: true
  prefill: {min_replicas: 1, max_replicas: 1}
  decode: {min_replicas: 1, max_replicas: 2, running_per_replica: 3}
  scale_up_delay_s: 1
  scale_down_delay_s: 2
  scale_down_below: 0.9
  pending_timeout_s: 600            # a replica that starts slowly on a loaded machine is waited for
  max_backoff_s: 300
  graceful_shutdown_timeout_s: 60
"""
# a bound, not a pace: each wait returns when its condition holds (a replica starts slowly on a
# shared machine)
VIEW_TIMEOUT_S = 480.0


@pytest.fixture(scope="module")
def prompts(smol) -> tuple[list[int], list[list[int]]]:
    """The load's prompt and the long requests' prompts, as token ids."""
    tokenizer = smol.tokenizer
    return tokenizer(SHORT_PROMPT).input_ids, [tokenizer(p).input_ids for p in LONG_PROMPTS]


@pytest.fixture(scope="module")
def reference(smol, prompts) -> list[GreedyTrace]:
    """The engine alone, the long prompts in one batch, as the tokens' texts the API returns."""
    return engine_text_traces(smol, prompts[1], LONG_TOKENS)


@pytest.fixture(scope="module")
def base_url(shared_serve, tmp_path_factory) -> Iterator[str]:
    policy = tmp_path_factory.mktemp("policy") / "scaling.yaml"
    policy.write_text(POLICY)
    args = {
        "model.max_model_len": "512",
        "engine.kv_cache_bytes": str(64 << 20),
        "prefill.num_cpus": "0.25",
        "decode.num_cpus": "0.25",
        "autoscaling.policy": str(policy),
    }
    with shared_serve.apps([ServeApp("scaling", disagg_app, args)]) as served:
        yield served.url("scaling")


async def _view(client: httpx.AsyncClient) -> dict:
    response = await client.get("/admin/autoscaler")
    assert response.status_code == 200, response.text
    return response.json()


def _decode_replicas(view: dict) -> dict[str, int]:
    return {r["replica_id"]: r["load"]["decoding"] for r in view["replicas"] if r["deployment"] == "DecodeServer"}


SETTLED = {"target": 1, "reporting": 1, "pending": 0, "backoff_s": 0, "gpus_per_replica": 0, "target_gpus": 0}


def _pool(view: dict) -> dict:
    return view["scaling"]["pools"]["decode"]


async def _until(client: httpx.AsyncClient, what: str, test) -> dict:
    async def view_if() -> dict | None:
        view = ok_json(await client.get("/admin/autoscaler"))
        return view if view is not None and test(view) else None

    return await wait_until_async(view_if, VIEW_TIMEOUT_S, what, poll_s=0.25)


def _body(model: str, prompt_ids: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
    }


def _decode_engines(kv_answer: httpx.Response) -> set[str]:
    """The live decode replicas' engine ids on the KV-state board (a ``GET /admin/kv`` answer)."""
    view = ok_json(kv_answer)
    replicas = [] if view is None else view["replicas"]
    return {r["engine_id"] for r in replicas if r["live"] and r["deployment"] == "DecodeServer"}


async def _decode_engines_async(client: httpx.AsyncClient) -> set[str]:
    return _decode_engines(await client.get("/admin/kv"))


async def _until_set(event: asyncio.Event, send) -> list:
    """``send()`` one request after another until ``event`` is set; every answer, in order."""
    answers = []
    while not event.is_set():
        answers.append(await send())
    return answers


async def _scenario(base_url: str, prompts) -> tuple[list[int], list[list[httpx.Response]], dict, set[str]]:
    short_ids, long_ids = prompts
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        assert (await _view(client))["scaling"]["enabled"] is True
        load_over, shrunk = asyncio.Event(), asyncio.Event()

        def sender(prompt: list[int], max_tokens: int):
            return lambda: client.post("/v1/completions", json=_body(model, prompt, max_tokens))

        shorts = [asyncio.create_task(_until_set(load_over, sender(short_ids, SHORT_TOKENS))) for _ in range(NUM_LOAD)]
        await _until(client, "a second decode replica", lambda v: len(_decode_replicas(v)) == 2)
        engines = await wait_until_async(
            lambda: _decode_engines_async(client),
            VIEW_TIMEOUT_S,
            "both decode engines on the board",
            until=lambda e: len(e) == 2,
        )
        longs = [asyncio.create_task(_until_set(shrunk, sender(ids, LONG_TOKENS))) for ids in long_ids]
        load_over.set()
        short_answers = [r for answers in await asyncio.gather(*shorts) for r in answers]
        await _until(client, "the scale-down decision", lambda v: v["scaling"]["pools"]["decode"]["target"] == 1)
        await _until(client, "one decode replica left", lambda v: len(_decode_replicas(v)) == 1)
        shrunk.set()  # the long requests were in flight through the decision and the stop
        long_answers = await asyncio.gather(*longs)
        # the pool as it stays: a report that comes late reads as a pending replica for a moment
        final = await _until(client, "the decode pool settled at one replica", lambda v: _pool(v) == SETTLED)
        return [r.status_code for r in short_answers], long_answers, final, engines


def test_load_raises_the_decode_count_and_a_scale_down_loses_nothing(reference, prompts, base_url):
    statuses, long_answers, final, engines = asyncio.run(_scenario(base_url, prompts))
    assert statuses and set(statuses) == {200}
    for prompt, answers in enumerate(long_answers):
        assert answers, f"long prompt {prompt}: no request completed"
        for i, response in enumerate(answers):
            assert response.status_code == 200, response.text
            (choice,) = response.json()["choices"]
            assert choice["finish_reason"] == "length"
            logprobs = choice["logprobs"]
            trace = GreedyTrace(tuple(logprobs["tokens"]), tuple(tuple(top) for top in logprobs["top_logprobs"]))
            assert len(trace.tokens) == LONG_TOKENS >= MIN_COMPARED_TOKENS
            assert_same_output(reference[prompt], trace, exact=False, label=f"long prompt {prompt}, request {i}")
    decisions = [(d["action"], d.get("pool"), tuple(d.get("replicas") or ())) for d in final["decisions"]]
    assert ("scale_up", "decode", (1, 2)) in decisions and ("scale_down", "decode", (2, 1)) in decisions
    assert not [d for d in decisions if d[0] in ("lend", "give_up")]
    # the stopped replica's peer-registry entry is gone (a handle naming it is refused as stale)
    (left,) = wait_until(
        lambda: _decode_engines(httpx.get(f"{base_url}/admin/kv", timeout=30)),
        VIEW_TIMEOUT_S,
        "one decode engine on the board",
        until=lambda e: len(e) == 1,
    )
    (stopped,) = engines - {left}
    registry = RayPeerRegistry()
    wait_until(lambda: registry.current(stopped) is None, VIEW_TIMEOUT_S, "the stopped engine's registry entry gone")
    assert registry.current(left) is not None
