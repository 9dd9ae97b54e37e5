"""The load generator against a running disaggregated app (real Ray, real HTTP): the server
sees the asked prompt lengths, outputs have max_tokens tokens, and a tiny sweep reports
attainment and goodput."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from bench.serve import Target, run, sweep, uncontended
from bench.slo import SLO
from tests.serving import ServeApp
from workloads import make_requests, median_request

CONTEXT = 512


@pytest.fixture(scope="module")
def target(shared_serve) -> Iterator[Target]:
    from app.config import disagg_app

    args = {
        "model.max_model_len": str(CONTEXT),
        "engine.kv_cache_bytes": str(64 << 20),
        "prefill.num_cpus": "0.25",
        "decode.num_cpus": "0.25",
        "autoscaling.enabled": "false",
    }
    with shared_serve.apps([ServeApp("bench", disagg_app, args)]) as served:
        model = httpx.get(served.url("bench") + "/v1/models", timeout=30).json()["data"][0]
        assert model["max_model_len"] == CONTEXT
        yield Target(served.url("bench"), model["id"])


@pytest.fixture(scope="module")
def tokenizer(smol):
    return smol.tokenizer


def test_server_sees_the_asked_lengths(target, tokenizer):
    requests = [
        *make_requests("code", tokenizer, CONTEXT, 3, seed=1),
        *make_requests("chatbot", tokenizer, CONTEXT, 2, seed=2),
        *make_requests("summarization", tokenizer, CONTEXT, 1, seed=3),
    ]
    records, duration = asyncio.run(run(target, requests, [0.2 * i for i in range(len(requests))], progress=False))
    assert duration > 0
    for request, record in zip(requests, records):
        assert record.ok, record.error
        assert record.usage_prompt_tokens == request.prompt_tokens == len(request.prompt)
        assert record.usage_output_tokens == request.max_tokens
        assert len(record.chunks) <= request.max_tokens and record.ttft > 0 and record.e2e >= record.ttft


def test_tiny_sweep_reports_attainment_and_goodput(target, tokenizer):
    requests = make_requests("code", tokenizer, CONTEXT, 4, seed=4)
    base = uncontended(target, median_request(requests), repeats=1, max_tokens=8)
    assert base["ttft_s"] > 0 and base["tpot_s"] > 0
    generous, impossible = SLO(60.0, 10.0), SLO(1e-4, 1e-4)
    result = sweep(target, requests, [4.0, 8.0], generous, seed=5)
    assert [p["attainment"] for p in result["points"]] == [1.0, 1.0]
    assert result["goodput"] == {"rate": 8.0, "bound": "at_least", "text": ">= 8"}
    assert all(p["completed"] == 4 and len(p["records"]) == 4 for p in result["points"])
    result = sweep(target, requests[:2], [4.0], impossible, seed=5)
    assert result["points"][0]["attainment"] == 0.0 and result["goodput"]["bound"] == "below"
