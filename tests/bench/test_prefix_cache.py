"""bench.prefix_cache's arithmetic: the Prometheus counters and one setting's figures from its
rows (its chat turns run against a real app in tests/bench/test_serve_bench.py)."""

from __future__ import annotations

import pytest

from bench.prefix_cache import parse_counters, ratios, same_answers, summarize

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
