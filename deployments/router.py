"""Role-aware request router for the engine deployments.

Both ``PrefillServer`` and ``DecodeServer`` use it. It reads each replica's current role
and load from ``EngineServer.record_routing_stats`` and sends prefill calls only to
replicas in the ``prefill`` (or ``both``) role and decode calls only to ``decode`` (or
``both``) replicas, so a prefill-deployment replica that the autoscaler flipped to
``decode`` receives decode work through the prefill deployment's handle. Among eligible
replicas the least loaded comes first: fewest waiting, then running requests, then most
free KV blocks (not round-robin).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

PREFILL_METHODS = frozenset({"prefill", "prefill_push"})
DECODE_METHODS = frozenset({"decode_pull", "decode_push", "generate"})


def wanted_role(method: str) -> str | None:
    if method in PREFILL_METHODS:
        return "prefill"
    if method in DECODE_METHODS:
        return "decode"
    return None  # control calls (stats, abort, set_role) go anywhere


def eligible(stats: dict[str, Any], role: str | None) -> bool:
    current = stats.get("role")
    return role is None or current is None or current in (role, "both")


def load_key(stats: dict[str, Any]) -> tuple[int, int, int]:
    return (stats.get("waiting", 0), stats.get("running", 0), -stats.get("free_blocks", 0))


def rank_replicas(replicas: list[Any], method: str) -> list[list[Any]]:
    """Pure ranking over objects with ``routing_stats`` (unit-tested without Serve)."""
    role = wanted_role(method)
    chosen = [r for r in replicas if eligible(r.routing_stats or {}, role)]
    return [[r] for r in sorted(chosen, key=lambda r: load_key(r.routing_stats or {}))]


class RoleAwareRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        method = pending_request.metadata.call_method if pending_request is not None else ""
        return rank_replicas(candidate_replicas, method)
