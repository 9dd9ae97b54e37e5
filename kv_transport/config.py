"""Transport settings, declared where they are used (the application's ``transport`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TransportKind = Literal["nixl", "object_store"]
TransferMode = Literal["pull", "push"]


class TransportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: TransportKind = Field("nixl", description="how KV moves from prefill to decode")
    mode: TransferMode = Field("pull", description="decode reads (pull) or prefill writes per layer (push)")
    kv_transfer_timeout_s: float = Field(60.0, gt=0, description="unclaimed KV is freed, and waits fail, after this")
    peer_check_interval_s: float = Field(
        5.0, gt=0, description="a cached peer is re-confirmed in the registry at most this often (restarts noticed)"
    )
