"""Replica scaling on a real local app (1 prefill + 1 decode to start, fractional CPUs).

A sustained decode-heavy load makes the controller raise the decode pool's target; the
decode replicas relay it to Serve, whose policy function follows it, and a second decode
replica starts and reports. When the load falls to a few long requests spread over both
replicas, the target falls back to 1 and Serve stops one of them: the requests in flight
there finish (Serve drains the replica, then its ``__del__`` keeps exported KV until
fetched) with the same greedy output as the engine alone (tests/same_output.py's rule).
Lending is off in this policy (``max_lent: 0``) so only the replica count moves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from app.config import disagg_app
from deployments.openai_format import token_text_of
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import ModelSpec, load_model
from engine.params import GenerationRequest, SamplingParams
from tests.same_output import MIN_COMPARED_TOKENS, GreedyTrace, assert_same_output, trace_from_outputs
from tests.serving import ServeApp, local_serve

PORT = 18590
LONG_TOKENS = 112  # long enough to outlast the scale-down decision (2 s of surplus) and Serve's stop
SHORT_TOKENS = 24
NUM_LOAD = 6  # streams kept in flight by the load: needs 2 decode replicas at 5 each
NUM_LONG = 4  # 4 <= 0.9 * 5 on one replica: the surplus that scales back down
PROMPT = "Write a long story about a lighthouse keeper and the ships that pass."
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
  decode: {min_replicas: 1, max_replicas: 2, running_per_replica: 5}
  scale_up_delay_s: 1
  scale_down_delay_s: 2
  scale_down_below: 0.9
  pending_timeout_s: 150
  max_backoff_s: 300
  graceful_shutdown_timeout_s: 60
"""
VIEW_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return load_model(ModelSpec(source="default")).tokenizer(PROMPT).input_ids


@pytest.fixture(scope="module")
def reference(prompt_ids) -> GreedyTrace:
    """The engine alone, as the tokens' texts the API returns."""
    loaded = load_model(ModelSpec(source="default"))
    core = EngineCore(loaded, EngineConfig(max_model_len=512, kv_cache_bytes=64 << 20))
    sampling = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    core.add_request(GenerationRequest("ref", tuple(prompt_ids), sampling))
    outputs = []
    while core.has_work():
        outputs += core.step()
    trace, text_of = trace_from_outputs(outputs), token_text_of(loaded.tokenizer)
    return GreedyTrace(tuple(map(text_of, trace.tokens)), tuple(tuple(map(text_of, top)) for top in trace.top))


@pytest.fixture(scope="module")
def base_url(tmp_path_factory) -> Iterator[str]:
    policy = tmp_path_factory.mktemp("policy") / "scaling.yaml"
    policy.write_text(POLICY)
    args = {
        "model.max_model_len": "512",
        "engine.kv_cache_bytes": str(64 << 20),
        "prefill.num_cpus": "0.25",
        "decode.num_cpus": "0.25",
        "autoscaling.policy": str(policy),
    }
    with local_serve([ServeApp("scaling", disagg_app, args)], port=PORT) as served:
        yield served.base_url


async def _view(client: httpx.AsyncClient) -> dict:
    response = await client.get("/admin/autoscaler")
    assert response.status_code == 200, response.text
    return response.json()


def _decode_replicas(view: dict) -> dict[str, int]:
    return {r["replica_id"]: r["load"]["decoding"] for r in view["replicas"] if r["deployment"] == "DecodeServer"}


async def _until(client: httpx.AsyncClient, what: str, test, timeout_s: float = VIEW_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = await _view(client)
        if test(view):
            return view
        await asyncio.sleep(0.25)
    raise AssertionError(f"no {what} within {timeout_s:.0f}s; last view: {view}")


def _body(model: str, prompt_ids: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
    }


async def _scenario(base_url: str, prompt_ids: list[int]) -> tuple[list[httpx.Response], list[dict], list[int]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        view = await _view(client)
        assert view["scaling"]["enabled"] is True
        stop = asyncio.Event()
        statuses: list[int] = []

        async def load() -> None:  # one stream after another until told to stop
            while not stop.is_set():
                response = await client.post("/v1/completions", json=_body(model, prompt_ids, SHORT_TOKENS))
                statuses.append(response.status_code)

        workers = [asyncio.create_task(load()) for _ in range(NUM_LOAD)]
        await _until(client, "second decode replica", lambda v: len(_decode_replicas(v)) == 2)
        # a few long requests, spaced so the router sees each one's load, then the load stops
        longs = []
        for _ in range(NUM_LONG):
            longs.append(
                asyncio.create_task(client.post("/v1/completions", json=_body(model, prompt_ids, LONG_TOKENS)))
            )
            await asyncio.sleep(0.75)
        stop.set()
        await asyncio.gather(*workers)
        views = []

        def scaled_down(v: dict) -> bool:
            if v["scaling"]["pools"]["decode"]["target"] == 1:
                return True
            views.append(v)  # the views before the decision
            return False

        await _until(client, "scale-down decision", scaled_down)
        responses = await asyncio.gather(*longs)
        await _until(client, "one decode replica left", lambda v: len(_decode_replicas(v)) == 1)
        views.append(await _view(client))
        return responses, views, statuses


def test_load_raises_the_decode_count_and_a_scale_down_loses_nothing(reference, prompt_ids, base_url):
    responses, views, statuses = asyncio.run(_scenario(base_url, prompt_ids))
    assert statuses and set(statuses) == {200}
    # just before the scale-down decision both decode replicas held long requests: whichever
    # Serve stopped had requests in flight
    assert views, "scaled down before the long requests were seen on the replicas"
    before = _decode_replicas(views[-2])
    assert len(before) == 2 and all(n >= 1 for n in before.values()), before
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        trace = GreedyTrace(tuple(logprobs["tokens"]), tuple(tuple(top) for top in logprobs["top_logprobs"]))
        assert len(trace.tokens) == LONG_TOKENS >= MIN_COMPARED_TOKENS
        assert_same_output(reference, trace, exact=False, label=f"long request {i}")
    final = views[-1]
    decisions = [(d["action"], d.get("pool"), tuple(d.get("replicas") or ())) for d in final["decisions"]]
    assert ("scale_up", "decode", (1, 2)) in decisions and ("scale_down", "decode", (2, 1)) in decisions
    assert not [d for d in decisions if d[0] in ("lend", "give_up")]
    assert final["scaling"]["pools"]["decode"] == {"target": 1, "reporting": 1, "pending": 0, "backoff_s": 0}
