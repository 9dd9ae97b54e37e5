"""bench.prefix_cache without a server: a streamed chat turn read from its SSE lines, the closed
loop's turn order, the Prometheus counters, and one setting's figures from its rows."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import bench.prefix_cache as prefix_cache
from bench.prefix_cache import chat_turn, closed_loop, parse_counters, ratios, same_answers, summarize
from workloads import ChatConversation

CHAT = ChatConversation(3, ("Hello.", "And then?"), max_tokens=2)


def _sse(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks).encode() + b"data: [DONE]\n\n"


def _turn(handler) -> dict:
    async def run() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await chat_turn(client, "http://server", "m", CHAT, ["Hi."])

    return asyncio.run(run())


def test_a_streamed_turn_gives_its_answer_usage_and_cached_tokens():
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
        body = _sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "Then "}}]},
                    {"choices": [{"delta": {"content": "more."}}]}, {"choices": [], "usage": usage})  # fmt: skip
        return httpx.Response(200, content=body)

    row = _turn(handler)
    assert sent[0]["messages"][-1] == {"role": "user", "content": "And then?"} and sent[0]["max_tokens"] == 2
    assert row["conversation"] == 3 and row["turn"] == 2 and row["answer"] == "Then more." and row["error"] is None
    assert (row["prompt_tokens"], row["output_tokens"], row["cached_tokens"]) == (40, 2, 32)
    assert row["ttft_s"] > 0 and row["tpot_s"] is not None


def test_a_failed_turn_says_why_and_has_no_times():
    row = _turn(lambda request: httpx.Response(503, content=b"overloaded"))
    assert row["error"] == "HTTP 503: b'overloaded'" and row["ttft_s"] is None and row["answer"] == ""
    row = _turn(lambda request: httpx.Response(200, content=_sse({"error": {"message": "too long"}})))
    assert row["error"] == "too long" and row["cached_tokens"] is None


def test_the_closed_loop_sends_each_turn_after_the_last_and_stops_a_conversation_at_a_failure(monkeypatch):
    async def fake_turn(client, url, model, chat, answers) -> dict:
        turn = len(answers) + 1
        error = "boom" if (chat.index, turn) == (1, 2) else None
        return {"conversation": chat.index, "turn": turn, "answer": f"{chat.index}.{turn}", "error": error}

    async def after_turn() -> dict:
        return {"kv_bytes": 7}

    monkeypatch.setattr(prefix_cache, "chat_turn", fake_turn)
    chats = [ChatConversation(i, ("a", "b", "c"), 1) for i in range(2)]
    rows, duration = asyncio.run(closed_loop("http://server", "m", chats, after_turn))
    assert [(r["conversation"], r["turn"]) for r in rows] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    assert [r.get("kv_bytes") for r in rows] == [7, 7, 7, 7, None] and duration >= 0


EXPORT = """\
# HELP ray_tandem_kv_transfer_bytes_total KV bytes moved
ray_tandem_kv_transfer_bytes_total{pool="decode",replica="a"} 1000.0
ray_tandem_kv_transfer_bytes_total{pool="decode",replica="b"} 500.0
ray_tandem_kv_transfer_seconds_count{pool="decode"} 3.0
ray_tandem_prefix_cache_hits_total{pool="prefill"} 64.0
ray_tandem_other_total{pool="prefill"} 9.0
ray_tandem_prefix_cache_queries_total 5.0
"""


def test_counters_are_summed_per_pool_without_rays_prefix_and_suffix():
    assert parse_counters(EXPORT) == {
        "tandem_kv_transfer_bytes/decode": 1500.0,
        "tandem_kv_transfer_seconds_count/decode": 3.0,
        "tandem_prefix_cache_hits/prefill": 64.0,
    }


def _raw(ttfts: list[float], cached: list[int], kv_bytes: float, answers: str = "ab") -> dict:
    turns = [
        {"conversation": 0, "turn": turn, "prompt_tokens": 100 * turn, "output_tokens": 10, "cached_tokens": c,
         "ttft_s": t, "tpot_s": 0.05, "error": None, "answer": answers[turn - 1]}
        for turn, (t, c) in enumerate(zip(ttfts, cached), start=1)
    ]  # fmt: skip
    turns.append({**turns[0], "conversation": 1, "output_tokens": None, "ttft_s": None, "error": "HTTP 500"})
    counters = {"tandem_kv_transfer_bytes/decode": kv_bytes, "tandem_kv_transfer_seconds_count/decode": 2.0}
    stats = {"query_tokens": 300, "hit_tokens": 96, "evictions": 0}
    return {"turns": turns, "duration_s": 4.0, "counters": counters, "prefill_stats": stats}


def test_a_settings_figures_and_the_ratios_of_on_and_off():
    on, off = summarize(_raw([1.0, 0.5], [16, 96], 2e6)), summarize(_raw([1.0, 2.0], [0, 0], 8e6, answers="ac"))
    assert on["requests"] == 3 and on["failed"] == 1 and on["output_tokens_per_s"] == pytest.approx(5.0)
    assert on["kv_bytes_per_request"] == 1e6 and on["ttft_turns2_5_s"]["p50"] == pytest.approx(0.5)
    assert on["per_turn"][1] | {"ttft_s": None} == {
        "turn": 2,
        "requests": 1,
        "prompt_tokens_mean": 200,
        "cached_tokens_mean": 96,
        "cached_tokens_min": 96,
        "cached_tokens_max": 96,
        "ttft_s": None,
    }
    assert on["prefill_prefix_hit_tokens"] == 96 and on["prefill_prefix_query_tokens"] == 300
    r = ratios(on, off)
    assert r["ttft_turns2_5_p50_off_on"] == pytest.approx(4.0) and r["kv_bytes_per_request_off_on"] == 4.0
    assert r["output_tokens_per_s_on_off"] == pytest.approx(1.0)
    assert same_answers(_raw([1, 1], [0, 0], 1, "ab"), _raw([1, 1], [0, 0], 1, "ac")) == {"compared": 2, "identical": 1}
