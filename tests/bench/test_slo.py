"""Metric math on hand-made timestamps: TTFT, TPOT, ITL, E2E, attainment, goodput."""

from __future__ import annotations

import math

import pytest

from bench.serve import arrival_times, split_means
from bench.slo import SLO, RequestRecord, attainment, distribution, goodput, summarize


def _record(sent=10.0, chunks=(10.5, 10.7, 11.0, 11.1), last=None, usage=None, error=None) -> RequestRecord:
    return RequestRecord(
        prompt_tokens=100,
        max_tokens=4,
        sent=sent,
        chunks=list(chunks),
        last=last if last is not None else (chunks[-1] if chunks else None),
        usage_output_tokens=usage,
        error=error,
    )


def test_ttft_tpot_itl_e2e_as_vllm_defines_them():
    r = _record()
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)  # (E2E - TTFT) / (output tokens - 1)
    assert r.itls == pytest.approx([0.2, 0.3, 0.1])
    # usage counts tokens when chunks carry several: TPOT divides by tokens, ITL stays per chunk
    r = _record(usage=7, last=11.3)
    assert r.output_tokens == 7 and r.e2e == pytest.approx(1.3)
    assert r.tpot == pytest.approx((1.3 - 0.5) / 6)
    assert _record(chunks=(10.5,)).tpot is None


def test_attainment_counts_both_slos_and_failures():
    slo = SLO(ttft_s=0.6, tpot_s=0.25)
    good = _record()  # TTFT 0.5, TPOT 0.2
    slow_first = _record(chunks=(10.7, 10.8, 10.9, 11.0))  # TTFT 0.7
    slow_tokens = _record(chunks=(10.5, 11.0, 11.5, 12.0))  # TPOT 0.5
    one_token = _record(chunks=(10.4,))  # no TPOT: meets that half
    failed = _record(chunks=(), error="HTTP 503")
    assert [slo.met(r) for r in (good, slow_first, slow_tokens, one_token, failed)] == [True, False, False, True, False]
    assert attainment([good, slow_first, slow_tokens, one_token, failed], slo) == pytest.approx(2 / 5)


def test_summary_distributions_and_throughput():
    records = [_record(sent=10.0 + i, chunks=[10.0 + i + 0.1 * (i + 1) + 0.05 * k for k in range(4)]) for i in range(5)]
    records.append(_record(chunks=(), error="boom"))
    s = summarize(records, duration_s=10.0, slo=SLO(0.35, 1.0))
    assert (s["requests"], s["completed"], s["failed"]) == (6, 5, 1)
    assert s["ttft_s"]["mean"] == pytest.approx(0.3) and s["ttft_s"]["p50"] == pytest.approx(0.3)
    assert s["ttft_s"]["p90"] == pytest.approx(0.46) and s["ttft_s"]["p99"] == pytest.approx(0.496)
    assert s["tpot_s"]["p50"] == pytest.approx(0.05) and s["itl_s"]["mean"] == pytest.approx(0.05)
    assert s["request_throughput"] == pytest.approx(0.5) and s["output_throughput"] == pytest.approx(2.0)
    assert s["attainment"] == pytest.approx(3 / 6)  # TTFT 0.1, 0.2, 0.3 pass; 0.4, 0.5 and the failure miss
    assert all(math.isnan(v) for v in distribution([]).values())


def test_goodput_is_the_interpolated_90_percent_crossing():
    points = [(0.5, 1.0), (1.0, 0.95), (1.5, 0.75), (2.0, 0.4)]
    found = goodput(points)
    assert found.bound == "exact" and found.rate == pytest.approx(1.0 + 0.5 * (0.95 - 0.9) / (0.95 - 0.75))
    assert goodput([(1.0, 0.92), (2.0, 0.91)]).bound == "at_least" and goodput([(1.0, 0.92), (2.0, 0.91)]).rate == 2.0
    assert goodput([(1.0, 0.5), (2.0, 0.95)]).bound == "below"  # the first failure ends the search
    assert goodput([(2.0, 0.4), (1.0, 1.0)]).rate == pytest.approx(1.0 + (1.0 - 0.9) / 0.6)  # order-free
    assert str(goodput([(1.0, 0.5)])) == "< lowest rate"
    with pytest.raises(ValueError, match="at least one"):
        goodput([])


def test_arrivals_are_seeded_and_have_the_asked_rate():
    a = arrival_times(4000, rate=2.0, seed=3)
    assert a == arrival_times(4000, rate=2.0, seed=3) and a[0] == 0.0
    assert len(a) / a[-1] == pytest.approx(2.0, rel=0.05)
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(1.0, rel=0.1)  # Poisson
    b = arrival_times(4000, rate=2.0, process="gamma", cv=3.0, seed=3)
    gaps = [y - x for x, y in zip(b, b[1:])]
    mean = sum(gaps) / len(gaps)
    assert len(b) / b[-1] == pytest.approx(2.0, rel=0.15)
    assert (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean == pytest.approx(3.0, rel=0.2)
    with pytest.raises(ValueError, match="rate must be > 0"):
        arrival_times(3, rate=0)


def test_server_split_means_are_deltas_between_scrapes():
    before = {"prefill_queue": (1.0, 4.0), "kv_transfer": (0.2, 4.0)}
    after = {"prefill_queue": (3.0, 8.0), "kv_transfer": (0.2, 4.0), "decode_queue": (0.5, 5.0)}
    assert split_means(before, after) == {"prefill_queue": pytest.approx(0.5), "decode_queue": pytest.approx(0.1)}
