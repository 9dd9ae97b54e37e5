"""The elastic autoscaler on the default app (1 prefill + 1 decode, the default policy).

A decode-heavy burst (short prompts, long outputs) makes the controller lend the prefill
replica; every request completes with the same greedy output as the engine alone
(tests/same_output.py's rule, compared on the tokens' texts the API returns), including
the ones admitted while the flip happens and the ones served whole on the lent replica.
After the burst the replica is reclaimed and prompts are prefilled there again; ``GET
/admin/autoscaler`` shows both decisions with the signals behind them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from app.config import disagg_app
from tests.same_output import MIN_COMPARED_TOKENS, GreedyTrace, assert_same_output, engine_text_traces
from tests.serving import ServeApp
from tests.waiting import ok_json, wait_until

NUM_TOKENS = MIN_COMPARED_TOKENS + 8
NUM_BURST = 24
MAX_BURST = 120
STAGGER_S = 0.25
QUESTIONS = (
    "Write a long story about a lighthouse keeper.",
    "Explain how a steam engine works, step by step.",
    "List the planets of the solar system and describe each one.",
    "Describe a walk through an old city at night.",
)
ARGS = {
    "model.max_model_len": "512",
    "engine.kv_cache_bytes": str(64 << 20),
    "prefill.num_cpus": "0.25",
    "decode.num_cpus": "0.25",
    "autoscaling.replica_scaling": "false",  # lending alone here (replica counts: test_replica_scaling_app)
    # the idle bound counts from arrival: on a slow machine the burst's last requests queue past
    # the default 60 s before their first token, which is load, not the stalled stream it bounds
    "limits.stream_idle_timeout_s": "600",
}


@pytest.fixture(scope="module")
def model_and_prompts(smol):
    return smol, [smol.tokenizer(q).input_ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(model_and_prompts) -> list[GreedyTrace]:
    """The engine alone, the prompts in one batch, as the tokens' texts (what the API returns)."""
    loaded, prompts = model_and_prompts
    return engine_text_traces(loaded, prompts, NUM_TOKENS)


@pytest.fixture(scope="module")
def base_url(shared_serve) -> Iterator[str]:
    with shared_serve.apps([ServeApp("elastic", disagg_app, ARGS)]) as served:
        yield served.url("elastic")


def _trace(choice: dict) -> GreedyTrace:
    logprobs = choice["logprobs"]
    return GreedyTrace(tuple(logprobs["tokens"]), tuple(tuple(top) for top in logprobs["top_logprobs"]))


async def _burst(base_url: str, model: str, prompts: list[list[int]]) -> list[httpx.Response]:
    """At least ``NUM_BURST`` requests, one every ``STAGGER_S``, and more (up to ``MAX_BURST``)
    until the ingress has routed one to the lent replica: when the lend comes depends on how
    fast this machine runs the burst, that it comes under a decode-heavy load does not."""
    body = {"model": model, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def lent() -> bool:
            view = ok_json(await client.get("/admin/autoscaler"))
            return view is not None and view["ingress"]["routed"]["lent"] >= 1

        sent = []
        for i in range(MAX_BURST):
            sent.append(
                asyncio.ensure_future(
                    client.post("/v1/completions", json={**body, "prompt": prompts[i % len(prompts)]})
                )
            )
            await asyncio.sleep(STAGGER_S)
            if i + 1 >= NUM_BURST and await lent():
                break
        return await asyncio.gather(*sent)


def _admin(base_url: str) -> dict:
    response = httpx.get(base_url + "/admin/autoscaler", timeout=30)
    assert response.status_code == 200
    return response.json()


def _roles(view: dict | None) -> dict[str, str]:
    """Each engine deployment's replica's role, as the controller last saw it reported."""
    return {r["deployment"]: r["role"] for r in view["replicas"]} if view is not None else {}


def _admin_or_none(base_url: str) -> dict | None:
    """For waits: the view, or None while the controller does not answer in time (503)."""
    return ok_json(httpx.get(base_url + "/admin/autoscaler", timeout=30))


def _actions(view: dict) -> list[str]:
    return [d["action"] for d in view["decisions"]]


def _check_same(responses: list[httpx.Response], reference: list[GreedyTrace], offset: int = 0) -> None:
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["finish_reason"] == "length"
        k = (i + offset) % len(reference)
        assert_same_output(reference[k], _trace(choice), exact=False, label=f"request {i}")


def test_burst_lends_then_reclaims_and_every_output_is_the_engines(base_url, model_and_prompts, reference):
    _, prompts = model_and_prompts
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    view = _admin(base_url)
    assert view["enabled"] is True and view["policy"] == "default"
    home = {"PrefillServer": "prefill", "DecodeServer": "decode"}  # once both replicas have reported
    wait_until(lambda: _roles(_admin_or_none(base_url)), 60, "both replicas' first reports", until=home.__eq__)

    responses = asyncio.run(_burst(base_url, model, prompts))
    _check_same(responses, reference)

    view = _admin(base_url)
    lends = [d for d in view["decisions"] if d["action"] == "lend"]
    assert lends, view["decisions"]
    assert lends[0]["role"] == "both" and "decode" in lends[0]["reason"] and ">= enter" in lends[0]["reason"]
    prefill_replica = next(r["replica_id"] for r in view["replicas"] if r["deployment"] == "PrefillServer")
    assert lends[0]["replica"] == prefill_replica
    routed = view["ingress"]["routed"]
    assert routed["lent"] >= 1, routed  # whole requests served on the lent replica, checked above

    def reclaimed(view: dict | None) -> bool:
        return view is not None and "reclaim" in _actions(view)

    def applied(view: dict | None) -> bool:  # on the replica, and in the plan the ingress routes by
        return _roles(view).get("PrefillServer") == "prefill" and view["ingress"]["plan"]["lent"] == 0

    wait_until(lambda: _admin_or_none(base_url), 90, "the lent replica to be reclaimed", until=reclaimed)
    wait_until(
        lambda: _admin_or_none(base_url), 30, "the reclaim applied on the replica and the ingress", until=applied
    )
    view = _admin(base_url)
    first_lend = _actions(view).index("lend")
    reclaim = next(d for d in view["decisions"][first_lend:] if d["action"] == "reclaim")
    assert reclaim["replica"] == prefill_replica and reclaim["role"] == "prefill"
    assert "<= leave" in reclaim["reason"] or ">= enter" in reclaim["reason"]

    # prompts are prefilled on the reclaimed replica again (the disaggregated path)
    before = view["ingress"]["routed"]
    body = {"model": model, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    after_burst = [
        httpx.post(base_url + "/v1/completions", json={**body, "prompt": p}, timeout=120) for p in prompts[:2]
    ]
    _check_same(after_burst, reference)
    routed = _admin(base_url)["ingress"]["routed"]
    assert routed["disaggregated"] == before["disaggregated"] + 2
    assert routed["lent"] == before["lent"]


def test_autoscaling_off_binds_no_controller():
    """``autoscaling.enabled=false`` gives fixed pools: no controller deployment, no reports."""
    off = disagg_app({**ARGS, "autoscaling.enabled": "false"})._bound_deployment
    assert off.init_kwargs["controller"] is None
    on = disagg_app(ARGS)._bound_deployment
    controller = on.init_kwargs["controller"]._bound_deployment
    assert controller.name == "AutoscalerController"
    prefill = on.init_kwargs["prefill"]._bound_deployment
    assert prefill.init_kwargs["controller"]._bound_deployment.name == "AutoscalerController"
