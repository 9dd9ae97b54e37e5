"""What the autoscaler's controller and the other deployments say to each other.

Frozen dataclasses that Ray pickles as they are, on both calls the controller answers::

    engine replica --ReplicaReport----------------> controller    (report, every 0.25 s)
                   <-- ReportAnswer: role, PoolTarget --
    ingress        --IngressReport----------------> controller    (sync, every 0.25 s)
                   <-- RoutingPlan ----------------

An engine replica takes the role in the answer, and relays its pool's ``PoolTarget`` to
Serve's autoscaling policy (``autoscaling.serve_policy``): Serve has no call addressed to
one replica, so the controller's decisions travel back on the replicas' own calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.params import EngineStats, Role


@dataclass(frozen=True)
class ReplicaReport:
    """One engine replica's load, as it reports it to the controller."""

    replica: str  # Serve's replica id
    deployment: str  # PrefillServer / DecodeServer
    home: Role  # the deployment's role: what the replica returns to
    stats: EngineStats
    stopping: bool = False  # the replica is being stopped: the controller leaves it out at once


@dataclass(frozen=True)
class PoolTarget:
    """One pool's replica count from one decision, as a replica relays it to Serve."""

    num_replicas: int
    seq: float  # the decision's sequence number (``RelayedTargets.seq``): larger is newer


@dataclass(frozen=True)
class ReportAnswer:
    """The controller's answer to a report."""

    role: Role  # the role the replica must have
    target: PoolTarget | None = None  # its pool's count; None: no decision yet, or replica scaling off


@dataclass(frozen=True)
class RelayedTargets:
    """Both pools' counts from the controller's latest replica-count decision, handed to each
    replica in its report answer (``for_pool``)."""

    prefill: int | None  # None: the pool has not reported yet (no target of its own)
    decode: int | None
    # the decision's wall-clock time (``ScaleState.decided_at`` on the wall clock): Serve's
    # policy follows the largest one a replica relays, and a restarted controller's decisions,
    # on any node, outrank what the replicas still relay from the old one
    seq: float

    @classmethod
    def of(cls, targets: Mapping[Role, int], seq: float) -> RelayedTargets:
        return cls(prefill=targets.get(Role.PREFILL), decode=targets.get(Role.DECODE), seq=seq)

    def for_pool(self, pool: Role) -> PoolTarget | None:
        """The target of ``pool`` (a replica's home role), or None."""
        num_replicas = {Role.PREFILL: self.prefill, Role.DECODE: self.decode}.get(pool)
        return None if num_replicas is None else PoolTarget(num_replicas, self.seq)


@dataclass(frozen=True)
class LatencySample:
    """One finished request, as the ingress measured it."""

    ttft_s: float
    tpot_s: float | None  # None: a one-token output
    prefill_s: float | None  # the prefill call (pull) or TTFT (push) of a disaggregated request; else None


@dataclass(frozen=True)
class IngressReport:
    """What one ingress saw since its last sync."""

    samples: tuple[LatencySample, ...] = ()  # requests that finished
    prompt_tokens: int = 0  # prompt tokens of the requests it admitted (on any route)
    seconds_per_prompt_token: float | None = None  # its prefill-speed estimate (``RouteBook``)


@dataclass(frozen=True)
class RoutingPlan:
    """What the ingress routes by: replicas per role, as applied on the replicas."""

    prefill: int  # replicas taking prompts
    decode: int  # decode-deployment replicas
    lent: int  # prefill-deployment replicas in role both (taking whole requests)
    decode_kv_usage: float | None
    tpot_p90_s: float | None
