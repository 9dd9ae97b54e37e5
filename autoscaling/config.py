"""The ``autoscaling`` section of the app's settings (``app.settings.AppConfig``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from autoscaling.policy import Policy, load_policy


class AutoscalingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: fixed pools, no controller (disagg_app only)")
    policy: str = Field("default", description="a policy in autoscaling/policies/ by name, or a YAML path")
    replica_scaling: bool = Field(
        True, description="false: each pool keeps its num_replicas (lending still works); true: the policy's scaling"
    )
    record: str | None = Field(None, description="append each decision's snapshot to this JSONL file (for replay)")

    _loaded: Policy | None = PrivateAttr(None)  # the file, read once

    @model_validator(mode="after")
    def _policy_loads(self) -> AutoscalingSettings:
        if self.enabled:
            self._loaded = load_policy(self.policy)  # refused at start, naming the file and the fields
        return self

    def load(self, ttft_ms: float | None = None, tpot_ms: float | None = None) -> Policy:
        """The policy, with the app's SLO targets in place of its own where they are set."""
        policy = self._loaded if self._loaded is not None else load_policy(self.policy)
        return policy.with_slo(ttft_ms, tpot_ms)
