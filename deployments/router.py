"""Role-aware request router for the engine deployments.

Both ``PrefillServer`` and ``DecodeServer`` use it. It reads each replica's current role
and load from ``EngineServer.record_routing_stats`` and sends prefill calls only to
replicas in the ``prefill`` (or ``both``) role and decode calls only to ``decode`` (or
``both``) replicas, so a prefill-deployment replica that the autoscaler flipped to
``decode`` receives decode work through the prefill deployment's handle. Among eligible
replicas the least loaded comes first: fewest waiting, then running requests, then most
free KV blocks (not round-robin), except that a prompt whose prefix this router sent to a
replica before goes there while that replica is within a load bound
(``deployments.prefix_routing``: its prefix cache likely holds those blocks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from deployments.prefix_routing import PrefixAffinity, prompt_keys
from engine.params import EngineStats, Role

PREFILL_METHODS = frozenset({"prefill", "prefill_push"})
DECODE_METHODS = frozenset({"decode_pull", "decode_push", "generate"})


@dataclass(frozen=True)
class RoutingStats:
    """One replica's role and load, as the router ranks it."""

    role: Role
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int

    @classmethod
    def of(cls, stats: EngineStats) -> RoutingStats:
        return cls(
            role=stats.role,
            free_blocks=stats.num_free_blocks,
            total_blocks=stats.num_total_blocks,
            running=stats.num_running,
            waiting=stats.num_waiting,
        )

    def to_dict(self) -> dict[str, Any]:
        """What ``record_routing_stats`` returns: Serve keeps a plain dict per replica (read in
        Serve's controller, which need not import this package: the role goes as its string)."""
        return {**asdict(self), "role": self.role.value}


def parse_routing_stats(raw: dict[str, Any] | None) -> RoutingStats | None:
    """A replica's stats as Serve holds them (``to_dict``'s output); None before its first report."""
    if not raw:
        return None
    return RoutingStats(
        role=Role(raw["role"]),
        free_blocks=raw["free_blocks"],
        total_blocks=raw["total_blocks"],
        running=raw["running"],
        waiting=raw["waiting"],
    )


def wanted_role(method: str) -> Role | None:
    if method in PREFILL_METHODS:
        return Role.PREFILL
    if method in DECODE_METHODS:
        return Role.DECODE
    return None  # control calls (stats, abort, set_role) go anywhere


def eligible(stats: RoutingStats | None, role: Role | None) -> bool:
    """A replica that has not reported yet takes any call."""
    return role is None or stats is None or stats.role in (role, Role.BOTH)


def load_key(stats: RoutingStats | None) -> tuple[int, int, int]:
    if stats is None:
        return (0, 0, 0)
    return (stats.waiting, stats.running, -stats.free_blocks)


def rank_replicas(replicas: list[Any], method: str) -> list[list[Any]]:
    """Pure ranking over objects with ``routing_stats`` (unit-tested without Serve).

    When no replica's last report shows the wanted role (a role change not reported yet),
    every replica is ranked: the engine admits or refuses by its role at that moment (a
    refused admission raises ``RoleError`` before anything is admitted, and the ingress takes
    another path), rather than the call waiting here for a report."""
    role = wanted_role(method)
    stats = [parse_routing_stats(r.routing_stats) for r in replicas]
    chosen = [(s, r) for s, r in zip(stats, replicas) if eligible(s, role)] or list(zip(stats, replicas))
    return [[r] for _, r in sorted(chosen, key=lambda pair: load_key(pair[0]))]


def with_affinity(ranks: list[list[Any]], keys: list[bytes], affinity: PrefixAffinity) -> list[list[Any]]:
    """``ranks`` with the replica that got this prompt's prefix first (when it is among them
    and within the load bound); the prompt is remembered at the replica ranked first."""
    replicas = [replica for rank in ranks for replica in rank]
    if not replicas:
        return ranks
    loads = {}
    for replica in replicas:
        stats = parse_routing_stats(replica.routing_stats)
        loads[replica.replica_id] = 0 if stats is None else stats.running + stats.waiting
    preferred = affinity.preferred(keys, loads)
    if preferred is not None:
        first = next(r for r in replicas if r.replica_id == preferred)
        ranks = [[first]] + [[r] for r in replicas if r is not first]
    affinity.remember(keys, ranks[0][0].replica_id)
    return ranks


def prompt_of(pending_request: PendingRequest | None) -> tuple[int, ...] | None:
    """The prompt of a call that carries a ``GenerationRequest`` first (prefill, decode, generate)."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "prompt_token_ids", None)


class RoleAwareRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        method = pending_request.metadata.call_method if pending_request is not None else ""
        ranks = rank_replicas(candidate_replicas, method)
        prompt = prompt_of(pending_request) if wanted_role(method) is not None else None
        keys = prompt_keys(prompt) if prompt else []
        if not keys:
            return ranks
        if not hasattr(self, "_affinity"):
            self._affinity = PrefixAffinity()
        return with_affinity(ranks, keys, self._affinity)
