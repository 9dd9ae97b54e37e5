"""Prometheus metrics through ``ray.serve.metrics`` (exported on Ray's metrics port).

Ingress: TTFT, TPOT and E2E histograms (TTFT is measured at the first token the client
receives) and the prefill hop of TTFT. Engine replicas: the TTFT split -- prefill queue
(admitted to the engine -> first prompt chunk runs), prefill compute (-> first token),
decode queue (decode call -> KV blocks reserved) and KV transfer seconds and bytes -- the
prefill call time, and gauges of KV block usage, running and waiting requests and role
(0 prefill, 1 decode, 2 both), refreshed from the engine's stats snapshot whenever Serve
reads the routing stats. What TTFT holds beyond the split is routing and Ray/Serve calls.
Engine metrics carry the label ``pool``: the deployment section (prefill, decode, colocated).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ray.serve.metrics import Counter, Gauge, Histogram

from engine.params import EngineStats, Role

if TYPE_CHECKING:
    from autoscaling.decide import ControllerState
    from autoscaling.snapshot import ReplicaLoad
    from kv_transport.engine_link import DecodeTimings

LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
ROLE_CODES = {Role.PREFILL: 0, Role.DECODE: 1, Role.BOTH: 2}


class IngressMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(
            "tandem_ttft_seconds",
            "Time to the first token the client receives",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("path",),
        )
        self.tpot = Histogram(
            "tandem_tpot_seconds",
            "Mean time per output token after the first",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("path",),
        )
        self.e2e = Histogram(
            "tandem_e2e_seconds", "Request latency end to end", boundaries=LATENCY_BOUNDARIES_S, tag_keys=("path",)
        )
        self.prefill_hop = Histogram(
            "tandem_ttft_prefill_hop_seconds",
            "Part of TTFT spent in the prefill call (queue + compute)",
            boundaries=LATENCY_BOUNDARIES_S,
        )
        self.requests = Counter("tandem_requests_total", "Requests by outcome", tag_keys=("status",))
        self.retries = Counter(
            "tandem_request_retries_total",
            "Requests retried once after a replica died or a KV transfer failed before their first token",
            tag_keys=("side",),
        )

    def observe(self, path: str, start: float, first: float | None, end: float, num_tokens: int) -> None:
        tags = {"path": path}
        self.e2e.observe(end - start, tags)
        if first is not None:
            self.ttft.observe(first - start, tags)
            if num_tokens > 1:
                self.tpot.observe((end - first) / (num_tokens - 1), tags)


def _latency(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> Histogram:
    return Histogram(name, description, boundaries=LATENCY_BOUNDARIES_S, tag_keys=tag_keys)


ENGINE_TOTALS = (  # (EngineStats field, counter, its description)
    ("prefix_query_tokens", "tandem_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
    ("prefix_hit_tokens", "tandem_prefix_cache_hits_total", "Prompt tokens whose KV the prefix cache held"),
    ("num_evictions", "tandem_prefix_cache_evictions_total", "Cached KV blocks evicted to make room"),
    ("spec_drafts", "tandem_spec_decode_drafts_total", "Decode steps that verified speculative proposals"),
    ("spec_draft_tokens", "tandem_spec_decode_draft_tokens_total", "Speculative tokens proposed"),
    ("spec_accepted_tokens", "tandem_spec_decode_accepted_tokens_total", "Speculative tokens accepted"),
    ("tp_all_reduce_s", "tandem_tp_all_reduce_seconds_total", "Rank 0's seconds in tensor-parallel all-reduces"),
)


class EngineMetrics:
    def __init__(self, section: str) -> None:
        """``section``: the replica's deployment section, the value of the ``pool`` label."""
        tags = ("pool",)
        self.tags = {"pool": section}
        self.prefill = _latency("tandem_prefill_seconds", "Prefill call time on the replica (queue + compute)", tags)
        self.prefill_queue = _latency(
            "tandem_ttft_prefill_queue_seconds",
            "TTFT part: admitted to the engine -> first prompt chunk scheduled",
            tags,
        )
        self.prefill_compute = _latency(
            "tandem_ttft_prefill_compute_seconds", "TTFT part: first prompt chunk scheduled -> first token", tags
        )
        self.decode_queue = _latency(
            "tandem_ttft_decode_queue_seconds",
            "TTFT part: decode call -> KV blocks reserved on the decode replica",
            tags,
        )
        self.kv_seconds = _latency("tandem_kv_transfer_seconds", "KV transfer time per request", tags)
        self.kv_bytes = Counter("tandem_kv_transfer_bytes_total", "KV bytes moved", tag_keys=tags)
        self.kv_expired = Counter(
            "tandem_kv_exports_expired_total", "Exported KV never claimed, freed at its lease's end", tag_keys=tags
        )
        self.block_usage = Gauge("tandem_kv_block_usage", "Fraction of KV blocks in use", tag_keys=tags)
        self.running = Gauge("tandem_running_requests", "Requests in the running batch", tag_keys=tags)
        self.waiting = Gauge("tandem_waiting_requests", "Requests waiting for admission", tag_keys=tags)
        self.role = Gauge("tandem_role", "Replica role: 0 prefill, 1 decode, 2 both", tag_keys=tags)
        self.ranks = Gauge("tandem_tensor_parallel_ranks", "Ranks each replica's model is split over", tag_keys=tags)
        self.cached_blocks = Gauge(
            "tandem_kv_cached_blocks", "Free KV blocks that keep a cached prefix (evictable)", tag_keys=tags
        )
        # counters of the engine's cumulative figures, by ``EngineStats`` field: each report adds the change
        self._counters = {field: Counter(name, text, tag_keys=tags) for field, name, text in ENGINE_TOTALS}
        self._totals = dict.fromkeys([*self._counters, "expired_exports"], 0)

    def prefill_call(self, seconds: float) -> None:
        self.prefill.observe(seconds, self.tags)

    def prefill_parts(self, queue_s: float, compute_s: float) -> None:
        self.prefill_queue.observe(queue_s, self.tags)
        self.prefill_compute.observe(compute_s, self.tags)

    def transfer(self, seconds: float, num_bytes: int) -> None:
        self.kv_seconds.observe(seconds, self.tags)
        if num_bytes > 0:  # 0 when this replica's prefix cache held every block (Ray refuses inc(0))
            self.kv_bytes.inc(num_bytes, self.tags)

    def expired_exports(self, total: int) -> None:
        """The transport's count since start (``num_expired_exports``)."""
        self._add_change(self.kv_expired, "expired_exports", total)

    def _add_change(self, counter: Counter, key: str, total: int) -> None:
        """A cumulative figure as a counter: what it grew by since the last report."""
        if total > self._totals[key]:  # Ray refuses inc(0)
            counter.inc(total - self._totals[key], self.tags)
            self._totals[key] = total

    def decode_parts(self, timings: DecodeTimings) -> None:
        self.decode_queue.observe(timings.decode_queue_s, self.tags)
        if timings.kv_transfer_s is not None and timings.kv_bytes is not None:
            self.transfer(timings.kv_transfer_s, timings.kv_bytes)

    def replica(self, stats: EngineStats) -> None:
        self.block_usage.set(1 - stats.num_free_blocks / stats.num_total_blocks, self.tags)
        self.running.set(stats.num_running, self.tags)
        self.waiting.set(stats.num_waiting, self.tags)
        self.role.set(ROLE_CODES[stats.role], self.tags)
        self.cached_blocks.set(stats.num_cached_blocks, self.tags)
        self.ranks.set(stats.tensor_parallel_size, self.tags)
        for field, counter in self._counters.items():
            self._add_change(counter, field, getattr(stats, field))


class AutoscalerMetrics:
    """The controller's actions and the replicas per role (``role``: as assigned; ``pool``:
    the replica's deployment section)."""

    def __init__(self) -> None:
        self.actions = Counter(
            "tandem_autoscaler_actions_total",
            "Autoscaler actions (lend, reclaim, drained, scale_up, scale_down, give_up)",
            tag_keys=("action",),
        )
        self.replicas = Gauge(
            "tandem_autoscaler_replicas", "Engine replicas by assigned role", tag_keys=("role", "pool")
        )
        self.target_replicas = Gauge(
            "tandem_autoscaler_target_replicas", "Replicas the autoscaler decided per pool", tag_keys=("pool",)
        )
        self.pending_replicas = Gauge(
            "tandem_autoscaler_pending_replicas",
            "Replicas asked for that do not report yet, per pool",
            tag_keys=("pool",),
        )

    def action(self, kind: str) -> None:
        self.actions.inc(1, {"action": kind})

    def roles(self, replicas: Iterable[ReplicaLoad], state: ControllerState) -> None:
        counts = {(role.value, pool): 0 for role in Role for pool in ("prefill", "decode")}
        for replica in replicas:
            pool = replica.home.value
            counts[(state.role_of(replica).value, pool)] += 1
        for (role, pool), count in counts.items():
            self.replicas.set(count, {"role": role, "pool": pool})

    def scaling(self, targets: Mapping[Role, int], reporting: Mapping[Role, int]) -> None:
        for pool, target in targets.items():
            tags = {"pool": pool.value}
            self.target_replicas.set(target, tags)
            self.pending_replicas.set(max(target - reporting.get(pool, 0), 0), tags)
