"""Transport settings, declared where they are used (the application's ``transport`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TransportKind = Literal["nixl", "object_store"]
TransferMode = Literal["pull", "push"]
StagingKind = Literal["none", "host"]
STAGING_KINDS: tuple[str, ...] = ("none", "host")
DEFAULT_STAGING_BYTES = 1 << 30


def check_staging(value: object) -> str:
    """``transport.staging`` as given, or ``ValueError`` naming the setting and its choices."""
    if value not in STAGING_KINDS:
        raise ValueError(f"transport.staging must be one of {', '.join(STAGING_KINDS)} (got {value!r})")
    return str(value)


class TransportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: TransportKind = Field("nixl", description="how KV moves from prefill to decode")
    mode: TransferMode = Field("pull", description="decode reads (pull) or prefill writes per layer (push)")
    kv_transfer_timeout_s: float = Field(60.0, gt=0, description="unclaimed KV is freed, and waits fail, after this")
    peer_check_interval_s: float = Field(
        5.0, gt=0, description="a cached peer is re-confirmed in the registry at most this often (restarts noticed)"
    )
    staging: StagingKind = Field(
        "none",
        description="NIXL only. none: NIXL moves the KV pool's own memory (GPU memory on CUDA, GPUDirect RDMA "
        "between nodes); host: KV goes through a pinned host buffer registered with NIXL (clusters without "
        "GPUDirect RDMA), copied from and into the pool on a side stream",
    )
    staging_bytes: int = Field(
        DEFAULT_STAGING_BYTES,
        gt=0,
        description="size of the host staging buffer (staging=host); a transfer that needs more than is free "
        "fails with StagingFullError naming this setting",
    )

    @field_validator("staging", mode="before")
    @classmethod
    def _known_staging(cls, value: object) -> str:
        return check_staging(value)
