"""bench.trace_replay's rules: the lengths scaled to the default model, and the thinning that
keeps the trace's times at the load asked for."""

from __future__ import annotations

from bench.trace_replay import CAPACITY_COMPRESSION, TRACE, scaled, served_capacity, simulated_throughput, thinned
from planner.sim_types import SimRequest
from planner.trace import read_trace, window


def test_lengths_are_scaled_and_clipped_to_the_benchmarks_context():
    requests = [SimRequest(0.0, 1020, 129), SimRequest(1.0, 40, 2), SimRequest(2.0, 20_000, 2_000)]
    assert [(r.prompt_tokens, r.output_tokens) for r in scaled(requests)] == [(128, 32), (16, 8), (384, 96)]
    assert all(r.prompt_tokens + r.output_tokens <= 512 for r in scaled(requests))


def test_thinning_keeps_one_in_m_at_the_traces_own_times_under_the_load_asked():
    requests = scaled(window(read_trace(TRACE), 1800.0, 120.0))
    cap = served_capacity()
    kept, m = thinned(requests, 0.6, cap)
    assert 0 < cap < 10 and m >= 1
    assert len(kept) == -(-len(requests) // m)  # one per run of m
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    assert len(requests) / span / m <= 0.6 * cap  # the smallest m under the load ...
    assert m == 1 or len(requests) / span / (m - 1) > 0.6 * cap  # ... and no smaller one is
    originals = {(round(r.arrival_s, 6), r.prompt_tokens, r.output_tokens) for r in requests}
    firsts = [q.arrival_s for q in requests[:m] if (q.prompt_tokens, q.output_tokens) ==
              (kept[0].prompt_tokens, kept[0].output_tokens)]  # fmt: skip
    assert any(all((round(r.arrival_s + first, 6), r.prompt_tokens, r.output_tokens) in originals for r in kept)
               for first in firsts)  # fmt: skip
    assert [r.arrival_s for r in kept] == sorted(r.arrival_s for r in kept)
    offered_rps = len(requests) / (span / CAPACITY_COMPRESSION)  # the compressed window's arrival rate
    assert 0 < simulated_throughput(requests) <= offered_rps  # it completes no faster than they arrive
