"""AppConfig: every setting of the Serve application, validated once at the edge.

Sources, later ones winning: the defaults below, a YAML file (``config=path.yaml``),
environment variables (``TANDEM__<SECTION>__<FIELD>``, e.g. ``TANDEM__TRANSPORT__MODE=push``),
and Serve builder arguments (``serve run app.config:disagg_app transport.mode=push``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

ENV_PREFIX = "TANDEM__"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    source: str = Field("default", description="'default' (embedded SmolLM2), a HF model directory, or a .gguf file")
    served_name: str | None = Field(None, description="model name clients send; defaults to the model's own name")
    dtype: str | None = Field(None, description="float32 (CPU default), bfloat16 or float16")
    device: str = Field("cpu", description="'cpu' or 'cuda'")
    max_model_len: int = Field(2048, ge=16, description="context length served (prompt + generated tokens)")


class EngineSettings(_Section):
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    kv_cache_bytes: int = Field(256 << 20, ge=1 << 20, description="KV pool size per replica, in bytes")
    max_num_seqs: int = Field(64, ge=1, description="most requests running at once per replica")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="token budget of one engine step")
    enable_chunked_prefill: bool = Field(False, description="split long prompts across steps")
    recompute_remote_kv: bool = Field(False, description="let decode replicas recompute preempted remote KV")
    cpu_packed_weights: bool = Field(
        True, description="CPU: keep a oneDNN-packed copy of the weights for batched steps (faster, 2x weight memory)"
    )


class PoolConfig(_Section):
    num_replicas: int = Field(1, ge=0, description="replicas of this deployment")
    num_cpus: float = Field(0.5, gt=0, description="CPUs reserved per replica (Ray)")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (Ray)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources that pin replicas to a node group, e.g. prefill_node"
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per replica")
    max_ongoing_requests: int = Field(64, ge=1, description="Serve's bound on requests in flight per replica")

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class TransportConfig(_Section):
    kind: Literal["nixl", "object_store"] = Field("nixl", description="how KV moves from prefill to decode")
    mode: Literal["pull", "push"] = Field("pull", description="decode reads (pull) or prefill writes per layer (push)")
    kv_transfer_timeout_s: float = Field(60.0, gt=0, description="unclaimed KV is freed, and waits fail, after this")


class SLOConfig(_Section):
    ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token objective (benchmarks, autoscaling)")
    tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token objective")


class AppConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="what to serve")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="per-replica engine settings")
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="the prefill deployment")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="the decode deployment")
    colocated: PoolConfig = Field(
        default_factory=lambda: PoolConfig(num_replicas=2), description="colocated_app: replicas doing both phases"
    )
    transport: TransportConfig = Field(default_factory=TransportConfig, description="KV transport")
    disagg_min_prompt_tokens: int = Field(
        0, ge=0, description="conditional disaggregation: shorter prompts are prefilled on the decode replica"
    )
    max_queued_requests: int = Field(256, ge=1, description="requests the ingress holds before answering 503")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="service-level objectives")

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.transport.kind == "object_store" and self.transport.mode == "push":
            raise ValueError("transport.mode=push needs transport.kind=nixl (the object store supports pull only)")
        budget = self.engine.max_num_batched_tokens
        if budget is not None and not self.engine.enable_chunked_prefill and budget < self.model.max_model_len:
            raise ValueError(
                f"engine.max_num_batched_tokens={budget} < model.max_model_len={self.model.max_model_len} "
                "needs engine.enable_chunked_prefill=true"
            )
        if self.disagg_min_prompt_tokens >= self.model.max_model_len:
            raise ValueError("disagg_min_prompt_tokens must be below model.max_model_len")
        return self

    @classmethod
    def load(cls, args: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> AppConfig:
        """Defaults < YAML file (``args['config']``) < environment < the other builder args."""
        args = dict(args or {})
        data: dict[str, Any] = {}
        path = args.pop("config", None)
        if path:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping at the top level")
            data = loaded
        env = os.environ if environ is None else environ
        for key, value in env.items():
            if key.startswith(ENV_PREFIX):
                _set_dotted(data, key[len(ENV_PREFIX) :].lower().replace("__", "."), yaml.safe_load(value))
        for key, value in args.items():
            _set_dotted(data, key, yaml.safe_load(value) if isinstance(value, str) else value)
        return cls.model_validate(data)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            raise ValueError(f"{dotted}: {part} is not a section")
    data[leaf] = value


def disagg_app(args: dict[str, str] | None = None):
    """``serve run app.config:disagg_app [config=path.yaml] [section.field=value ...]``"""
    from deployments.build import build_disagg

    return build_disagg(AppConfig.load(args))


def colocated_app(args: dict[str, str] | None = None):
    """The baseline: replicas that do both phases (``colocated.num_replicas``, default 2)."""
    from deployments.build import build_colocated

    return build_colocated(AppConfig.load(args))
