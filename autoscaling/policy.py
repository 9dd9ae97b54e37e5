"""The autoscaling policy: a YAML file read once at start, validated here.

Shipped policies live in ``autoscaling/policies/`` (``default``, ``latency_first``,
``cost_first``); ``autoscaling.policy`` names one of them or gives a path. Every field is
documented in the shipped files. Contradictory values (an ``enter`` threshold below its
``leave``, a ``min`` above its ``max``, ...) are refused with a message naming the fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.params import Role

POLICY_DIR = Path(__file__).parent / "policies"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Band(_Strict):
    """A signal's hysteresis: pressure starts at ``enter`` and ends once at or below ``leave``.
    ``None`` for both turns the signal off."""

    enter: float | None = Field(None, ge=0)
    leave: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Band:
        if (self.enter is None) != (self.leave is None):
            raise ValueError("enter and leave are set together (or both left out to turn the signal off)")
        if self.enter is not None and self.enter <= self.leave:
            raise ValueError(f"enter ({self.enter}) must be above leave ({self.leave})")
        return self

    @property
    def on(self) -> bool:
        return self.enter is not None

    def entered(self, value: float | None) -> bool:
        return self.on and value is not None and value >= self.enter

    def left(self, value: float | None) -> bool:
        """At or below ``leave`` (an unmeasured or unused signal counts as calm)."""
        return not self.on or value is None or value <= self.leave


class SLOTargets(_Strict):
    ttft_p90_ms: float = Field(gt=0, description="time to first token, 90th percentile")
    tpot_p90_ms: float = Field(gt=0, description="time per output token, 90th percentile")


class DecodePressure(_Strict):
    """When the decode pool needs help (any signal at ``enter``) and when it no longer does
    (every signal at or below ``leave``). Demand is measured against the decode
    deployment's own replicas, so lending does not make the pressure look gone."""

    kv_usage: Band = Field(default_factory=Band, description="KV blocks used by decodes / the decode replicas' blocks")
    waiting: Band = Field(default_factory=Band, description="requests waiting for admission on decode replicas")
    running_per_replica: Band = Field(default_factory=Band, description="decoding requests per decode replica")
    tpot_slo_ratio: Band = Field(default_factory=Band, description="observed TPOT p90 over the window / the SLO")


class PrefillPressure(_Strict):
    """When prompts need every prefill replica back (any signal at ``enter``), and when the
    prefill side is calm enough to lend (every signal at or below ``leave``)."""

    queued_prompt_tokens: Band = Field(
        default_factory=Band, description="prompt tokens not yet computed, per prefill replica"
    )
    ttft_slo_ratio: Band = Field(
        default_factory=Band, description="observed prefill part of TTFT, p90 over the window / the TTFT SLO"
    )


class RoleBounds(_Strict):
    """Lending reads ``prefill.min`` and ``decode.max``; a lent replica still takes prompts
    and no decode replica is lent, so ``prefill.max`` and ``decode.min`` bound only the replica
    counts (checked for consistency here, read by replica-count scaling)."""

    min: int = Field(0, ge=0, description="replicas kept in this role only (never lent)")
    max: int = Field(64, ge=1, description="replicas serving this role at most (lent ones included)")

    @model_validator(mode="after")
    def _ordered(self) -> RoleBounds:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not be above max ({self.max})")
        return self


class Replicas(_Strict):
    prefill: RoleBounds = Field(default_factory=RoleBounds)
    decode: RoleBounds = Field(default_factory=lambda: RoleBounds(min=1))


class PromptPlacement(_Strict):
    """Conditional disaggregation by load: a prompt is prefilled on a decode replica when the
    prefill queue would break the TTFT SLO and the decode side has room within its TPOT SLO."""

    enabled: bool = True
    ttft_slo_ratio: float = Field(
        0.8, gt=0, description="offload once the predicted TTFT at prefill passes this share of the SLO"
    )
    max_tpot_slo_ratio: float = Field(
        0.7, gt=0, description="only while the observed TPOT p90 is below this share of the SLO"
    )
    max_kv_usage: float = Field(0.8, gt=0, le=1, description="only while the decode replicas' KV usage is below this")
    max_prompts_per_replica: int = Field(1, ge=1, description="prompts prefilling on one decode replica at once")


class PoolScaling(_Strict):
    """One pool's replica count: Serve's min/max and the load one replica is sized for
    (``None`` turns a signal off)."""

    min_replicas: int = Field(1, ge=1, description="replicas of the deployment at least")
    max_replicas: int = Field(1, ge=1, description="replicas of the deployment at most")

    @model_validator(mode="after")
    def _ordered(self) -> PoolScaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not be above max_replicas ({self.max_replicas})")
        return self


class PrefillScaling(PoolScaling):
    queued_prompt_tokens: float | None = Field(
        None, gt=0, description="target prompt tokens not yet computed, per prefill-role replica"
    )
    busy_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="target share of a prefill replica's time computing prompts, for the prompt tokens arriving"
        " per second x the seconds per prompt token",
    )


class DecodeScaling(PoolScaling):
    running_per_replica: float | None = Field(None, gt=0, description="target decoding requests per decode replica")
    kv_usage: float | None = Field(None, gt=0, le=1, description="target share of decode KV blocks in use")


class Scaling(_Strict):
    """Replica counts of both pools, decided together (``autoscaling/scale.py``): a pool grows
    to the replicas its load needs at the targets once that need has lasted
    ``scale_up_delay_s``, and shrinks once the load would stay under
    ``scale_down_below`` of the targets on one replica fewer for ``scale_down_delay_s``."""

    enabled: bool = Field(True, description="false: each pool keeps its num_replicas (lending still works)")
    prefill: PrefillScaling = Field(default_factory=PrefillScaling)
    decode: DecodeScaling = Field(default_factory=DecodeScaling)
    scale_up_delay_s: float = Field(10.0, ge=0, description="a need for more replicas must last this long")
    scale_down_delay_s: float = Field(60.0, ge=0, description="a surplus must last this long")
    scale_down_below: float = Field(
        0.6, gt=0, lt=1, description="shrink only when one replica fewer would run below this share of the targets"
    )
    pending_timeout_s: float = Field(
        120.0, gt=0, description="replicas asked for but not reporting after this are given up (a pod left Pending)"
    )
    max_backoff_s: float = Field(600.0, gt=0, description="after giving up, wait at most this long before asking again")
    graceful_shutdown_timeout_s: float = Field(
        120.0, gt=0, description="Serve's bound on a stopping replica's drain: its decodes and exported KV"
    )

    def pool(self, pool: Role) -> PoolScaling:
        """The bounds and targets of ``pool`` (``prefill`` or ``decode``)."""
        if pool is Role.PREFILL:
            return self.prefill
        if pool is Role.DECODE:
            return self.decode
        raise ValueError(f"no replica scaling for role {pool.value!r}")


class Policy(_Strict):
    name: str = Field("custom", description="shown by GET /admin/autoscaler (the file's name by default)")
    slo: SLOTargets
    interval_s: float = Field(1.0, gt=0, description="seconds between decisions")
    cooldown_s: float = Field(10.0, ge=0, description="seconds after a lend or reclaim before the next one")
    window_s: float = Field(20.0, gt=0, description="observed TTFT / TPOT are the p90 over this many seconds")
    min_samples: int = Field(5, ge=1, description="requests in the window before observed latencies count")
    stale_after_s: float = Field(5.0, gt=0, description="a replica silent this long is left out of decisions")
    max_lent: int = Field(1, ge=0, description="prefill replicas lent to decode at once")
    drain_timeout_s: float = Field(
        30.0, gt=0, description="a reclaimed replica counts as drained after this, its decodes still finishing"
    )
    replicas: Replicas = Field(default_factory=Replicas)
    decode_pressure: DecodePressure = Field(default_factory=DecodePressure)
    prefill_pressure: PrefillPressure = Field(default_factory=PrefillPressure)
    prompt_placement: PromptPlacement = Field(default_factory=PromptPlacement)
    scaling: Scaling = Field(default_factory=lambda: Scaling(enabled=False))

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        if self.window_s < self.interval_s:
            raise ValueError(f"window_s ({self.window_s}) must be at least interval_s ({self.interval_s})")
        if self.stale_after_s < self.interval_s:
            raise ValueError(f"stale_after_s ({self.stale_after_s}) must be at least interval_s ({self.interval_s})")
        pressure = self.decode_pressure
        if not any(
            band.on
            for band in (pressure.kv_usage, pressure.waiting, pressure.running_per_replica, pressure.tpot_slo_ratio)
        ):
            if self.max_lent > 0:
                raise ValueError("decode_pressure: no signal is on, so max_lent must be 0")
        if self.replicas.prefill.min > self.scaling.prefill.min_replicas:
            raise ValueError(
                f"replicas.prefill.min ({self.replicas.prefill.min}) never-lent replicas need"
                f" scaling.prefill.min_replicas ({self.scaling.prefill.min_replicas}) at least as high"
            )
        if pressure.kv_usage.on and pressure.kv_usage.enter > 1:
            raise ValueError(f"decode_pressure.kv_usage.enter ({pressure.kv_usage.enter}) is a share: at most 1")
        return self

    def with_slo(self, ttft_ms: float | None, tpot_ms: float | None) -> Policy:
        """This policy with the app's ``slo`` section (when set) in place of its own targets."""
        slo = self.slo.model_copy(
            update={k: v for k, v in (("ttft_p90_ms", ttft_ms), ("tpot_p90_ms", tpot_ms)) if v is not None}
        )
        return self.model_copy(update={"slo": slo})


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the file and the fields."""


def policy_path(name_or_path: str) -> Path:
    """A shipped policy's name (``latency_first``) or a path to a YAML file."""
    candidate = POLICY_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and not name_or_path.endswith((".yaml", ".yml")) and candidate.exists():
        return candidate
    path = Path(name_or_path)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in POLICY_DIR.glob("*.yaml")))
        raise PolicyError(f"autoscaling.policy: no policy {name_or_path!r} (shipped: {shipped}; or give a YAML path)")
    return path


def load_policy(name_or_path: str) -> Policy:
    path = policy_path(name_or_path)
    try:
        data: Any = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not YAML ({exc})") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{path}: expected a mapping at the top level")
    data.setdefault("name", path.stem)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'policy'}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise PolicyError(f"{path}: {problems}") from None
