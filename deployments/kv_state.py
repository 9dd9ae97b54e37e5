"""Each engine replica's KV accounting, published for ``GET /admin/kv``.

Every replica publishes its ``KVReport`` (taken on its engine thread, invariants checked)
into Ray's internal key-value store about once a second, keyed by its engine id; the
ingress reads them all. No call goes to a replica, so a dead or wedged one cannot hold the
answer up: its entry just ages (``age_s``), is marked not ``live`` after ``LIVE_WITHIN_S``
and dropped after ``FORGET_AFTER_S``, with its ranks' peer-registry entries (a crashed replica's: a
graceful stop removes both itself). Replicas sweep for such entries every ``SWEEP_PERIOD_S``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from engine.params import EngineStats, KVReport

NAMESPACE = "tandem_kv_state"
PUBLISH_PERIOD_S = 1.0
LIVE_WITHIN_S = 5.0  # a replica whose report is older is taken for dead
FORGET_AFTER_S = 120.0
SWEEP_PERIOD_S = 60.0


def entry(report: KVReport, replica: dict[str, Any]) -> dict[str, Any]:
    """The published form: the report's fields (``role`` as its value), ``ok``, the replica's
    identity (engine id, app, deployment, replica id, node id, pid, resident memory) and the wall time."""
    fields = dataclasses.asdict(report)
    fields["role"] = report.role.value
    fields["problems"] = list(report.problems)
    return {**replica, **fields, "ok": report.ok, "published_at": time.time()}


def speculative(stats: EngineStats) -> dict[str, Any]:
    """The replica's speculative decoding since start (vLLM's meaning: ``docs/metrics.md``)."""
    drafts, proposed, accepted = stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "tokens_per_verify_step": round(1 + accepted / drafts, 4) if drafts else None,
    }


def publish(engine_id: str, data: dict[str, Any]) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(engine_id, json.dumps(data), overwrite=True, namespace=NAMESPACE)


def remove(engine_id: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(engine_id, namespace=NAMESPACE)


def forget(engine_id: str, num_ranks: int = 1) -> None:
    """A replica silent for ``FORGET_AFTER_S`` is gone: its entry goes, and the peer-registry
    entries of its ranks, so that a handle naming it is refused as stale instead of read from a
    dead peer."""
    from kv_transport.registry import RayPeerRegistry
    from kv_transport.sharded import rank_engine_id

    remove(engine_id)
    registry = RayPeerRegistry()
    for peer_id in (engine_id, *(rank_engine_id(engine_id, rank) for rank in range(1, num_ranks))):
        if (info := registry.current(peer_id)) is not None:
            registry.remove(peer_id, info.incarnation)


def read_all(app: str | None = None) -> list[dict[str, Any]]:
    """Every replica's latest entry (of Serve application ``app``, or all) with ``age_s`` and
    ``live``; entries older than ``FORGET_AFTER_S`` are deleted on the way."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    now, entries = time.time(), []
    for key in _internal_kv_list("", namespace=NAMESPACE):
        raw = _internal_kv_get(key, namespace=NAMESPACE)
        if raw is None:
            continue
        data = json.loads(raw)
        if app is not None and data.get("app") != app:
            continue
        age = now - data["published_at"]
        if age > FORGET_AFTER_S:
            forget(key.decode() if isinstance(key, bytes) else key, len(data.get("ranks") or [None]))
            continue
        entries.append({**data, "age_s": round(age, 3), "live": age <= LIVE_WITHIN_S})
    return sorted(entries, key=lambda e: (e["deployment"], e["engine_id"]))


def summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``GET /admin/kv``'s body: ``ok`` when every live replica's invariants hold."""
    live = [e for e in entries if e["live"]]
    return {
        "ok": all(e["ok"] for e in live),
        "live_replicas": len(live),
        "replicas": entries,
    }
