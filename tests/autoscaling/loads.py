"""Replica loads for the autoscaler's pure tests (decide, scale)."""

from __future__ import annotations

from autoscaling.snapshot import ReplicaLoad
from engine.params import Role

TOTAL_BLOCKS = 100


def replica_load(
    name: str,
    role: Role | None = None,
    *,
    decoding: int = 0,
    waiting: int = 0,
    queued: int = 0,
    used_blocks: int = 0,
    pinned_blocks: int = 0,
    total_blocks: int = TOTAL_BLOCKS,
) -> ReplicaLoad:
    """``p*`` replicas are PrefillServer's (home prefill), the others DecodeServer's."""
    home = Role.PREFILL if name.startswith("p") else Role.DECODE
    return ReplicaLoad(
        replica=name,
        deployment="PrefillServer" if home is Role.PREFILL else "DecodeServer",
        home=home,
        role=role or home,
        running=decoding,
        decoding=decoding,
        waiting=waiting,
        queued_prompt_tokens=queued,
        free_blocks=total_blocks - used_blocks - pinned_blocks,
        pinned_blocks=pinned_blocks,
        total_blocks=total_blocks,
        median_step_ms=20.0,
    )
