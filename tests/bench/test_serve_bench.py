"""The load generator against a running disaggregated app (real Ray, real HTTP): the server
sees the asked prompt lengths, outputs have max_tokens tokens, a tiny sweep reports
attainment and goodput, and bench.prefix_cache's closed loop of streamed chat turns gives each
turn's row in order, stopping a conversation at its first refused turn.

The app is test_serve_app's pull application (``tests.serving.served_disagg``): this module
runs just before that one and keeps it running for it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from bench.prefix_cache import closed_loop
from bench.serve import Target, run, sweep, uncontended
from bench.slo import SLO
from tests.serving import SERVED_CONTEXT, served_disagg
from workloads import ChatConversation, make_requests, median_request

SHARES_APPS_WITH = "tests.deployments.test_serve_app"
CONTEXT = 512  # the requests' context: half the server's, so prompts stay short


@pytest.fixture(scope="module")
def target(shared_serve) -> Iterator[Target]:
    app = served_disagg()
    with shared_serve.apps([app], keep=True) as served:
        model = httpx.get(served.url(app.name) + "/v1/models", timeout=30).json()["data"][0]
        assert model["max_model_len"] == SERVED_CONTEXT
        yield Target(served.url(app.name), model["id"])


@pytest.fixture(scope="module")
def tokenizer(smol):
    return smol.tokenizer


def test_server_sees_the_asked_lengths(target, tokenizer):
    made = [
        *make_requests("code", tokenizer, CONTEXT, 3, seed=1),
        *make_requests("chatbot", tokenizer, CONTEXT, 2, seed=2),
        *make_requests("summarization", tokenizer, CONTEXT, 1, seed=3),
    ]
    requests = [replace(r, max_tokens=min(r.max_tokens, 12)) for r in made]  # the prompts' lengths are the point
    records, duration = asyncio.run(run(target, requests, [0.2 * i for i in range(len(requests))], progress=False))
    assert duration > 0
    for request, record in zip(requests, records):
        assert record.ok, record.error
        assert record.usage_prompt_tokens == request.prompt_tokens == len(request.prompt)
        assert record.usage_output_tokens == request.max_tokens
        assert len(record.chunks) <= request.max_tokens and record.ttft > 0 and record.e2e >= record.ttft


def test_tiny_sweep_reports_attainment_and_goodput(target, tokenizer):
    # short answers (8 tokens): what is checked is the sweep's accounting, not the lengths
    requests = [replace(r, max_tokens=8) for r in make_requests("code", tokenizer, CONTEXT, 4, seed=4)]
    base = uncontended(target, median_request(requests), repeats=1, max_tokens=8)
    assert base["ttft_s"] > 0 and base["tpot_s"] > 0
    generous, impossible = SLO(60.0, 10.0), SLO(1e-4, 1e-4)
    result = sweep(target, requests, [4.0, 8.0], generous, seed=5)
    assert [p["attainment"] for p in result["points"]] == [1.0, 1.0]
    assert result["goodput"] == {"rate": 8.0, "bound": "at_least", "text": ">= 8"}
    assert all(p["completed"] == 4 and len(p["records"]) == 4 for p in result["points"])
    result = sweep(target, requests[:2], [4.0], impossible, seed=5)
    assert result["points"][0]["attainment"] == 0.0 and result["goodput"]["bound"] == "below"


def test_chat_turns_stream_in_order_and_a_refused_turn_ends_its_conversation(target):
    chats = [
        ChatConversation(0, ("Say hello.", "And then?", "Once more."), max_tokens=3),
        # turn 2 is over the context
        ChatConversation(1, ("Hi.", "word " * SERVED_CONTEXT, "never sent"), max_tokens=2),
    ]
    fetched = []

    async def after_turn() -> dict:
        fetched.append(len(fetched))
        return {"kv_bytes": fetched[-1]}

    rows, duration = asyncio.run(closed_loop(target.url, target.model, chats, after_turn))
    assert [(r["conversation"], r["turn"]) for r in rows] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    ok = [r for r in rows if r["error"] is None]
    assert len(ok) == 4 and sorted(r["kv_bytes"] for r in ok) == [0, 1, 2, 3] and duration > 0
    for row in ok:
        assert row["output_tokens"] == 3 - row["conversation"] and row["answer"] and row["ttft_s"] > 0
        assert row["cached_tokens"] is not None and 0 <= row["cached_tokens"] < row["prompt_tokens"]
    turns = {r["turn"]: r for r in rows if r["conversation"] == 0}
    assert turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"] < turns[3]["prompt_tokens"]
    refused = rows[-1]
    assert refused["error"].startswith("HTTP 400: ") and "messages" in refused["error"] and "kv_bytes" not in refused
    assert refused["ttft_s"] is None and refused["answer"] == ""
