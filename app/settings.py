"""The application's settings schema: every setting, validated once at the edge.

Sources, later ones winning: the defaults below, a YAML file (``config=path.yaml``),
environment variables (``TANDEM__<SECTION>__<FIELD>``, e.g. ``TANDEM__TRANSPORT__MODE=push``),
and Serve builder arguments (``serve run app.config:disagg_app transport.mode=push``).
Sections used by one package are declared there (``engine.config.EngineSettings``,
``kv_transport.config.TransportConfig``); this module assembles them. The deployments import
it; the entry points live in ``app.config``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from app.auth_settings import AuthConfig
from app.tool_calls import REASONING_PARSERS, TOOL_PARSERS
from autoscaling.config import AutoscalingSettings
from engine.config import EngineSettings, SpeculativeConfig, check_token_budget
from engine.params import Role
from kv_transport.config import TransportConfig
from kv_transport.faults import TRANSPORT_POINTS, FaultRule

ENV_PREFIX = "TANDEM__"
# the deployment section of each engine pool, by the role its replicas start in (``AppConfig.pool``);
# also the value of the engine metrics' ``pool`` label
POOL_SECTIONS = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.BOTH: "colocated"}


class _Section(BaseModel):
    # hide_input_in_errors: a refused setting is named, never echoed (inline API keys)
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class ModelConfig(_Section):
    source: str = Field("default", description="'default' (embedded SmolLM2), a HF model directory, or a .gguf file")
    served_name: str | None = Field(None, description="model name clients send; defaults to the model's own name")
    dtype: str | None = Field(None, description="float32 (CPU default), bfloat16 or float16")
    device: str = Field("cpu", description="'cpu' or 'cuda'")
    max_model_len: int = Field(2048, ge=16, description="context length served (prompt + generated tokens)")


class EngineSection(EngineSettings):
    """``engine.config.EngineSettings`` with the served app's default pool: 256 MiB per replica
    (the engine's own default is 1 GiB), and at least 1 MiB."""

    kv_cache_bytes: int = Field(
        256 << 20, ge=1 << 20, description="KV pool size per replica (per rank under tensor parallelism), in bytes"
    )


class DeploymentConfig(_Section):
    num_replicas: int = Field(1, ge=0, description="replicas of this deployment")
    num_cpus: float = Field(0.5, gt=0, description="CPUs reserved per replica (Ray)")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (Ray)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources that pin replicas to a node group, e.g. prefill_node"
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per replica (per rank)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks each replica's model is split over, one placement-group bundle (GPU) each"
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Serve's bound on requests in flight per replica")
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables of this pool's replicas (Ray runtime_env), e.g. {UCX_TLS: tcp}",
    )

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle: its CPUs, GPUs and custom resources."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return bundle


class SLOConfig(_Section):
    ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token objective (benchmarks, autoscaling)")
    tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token objective")


class LimitsConfig(_Section):
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="a request with no output for this long is aborted (its blocks freed): 504"
    )
    max_body_bytes: int = Field(
        4 << 20, ge=1024, description="request bodies over this many bytes are refused (413), read no further"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="prompts over this many tokens are refused (400); none: the context length"
    )
    max_tokens: int | None = Field(
        None, ge=1, description="max_tokens over this is refused (400), and is the default; none: the context"
    )
    max_concurrent_per_key: int | None = Field(
        None, ge=1, description="requests in flight per API key (429 beyond); none: unlimited; needs auth"
    )


class RecoveryConfig(_Section):
    retry: bool = Field(
        True, description="retry a request once when a replica dies or its KV transfer fails before its first token"
    )
    wait_s: float = Field(
        30.0, gt=0, le=600, description="how long a retry waits for a replica (e.g. a restarting one) before a 503"
    )


class ApiConfig(_Section):
    chat_template: str | None = Field(
        None, description="a Jinja chat template (a file, or the template itself) in place of the model's"
    )
    tool_call_parser: Literal[tuple(TOOL_PARSERS)] | None = Field(  # type: ignore[valid-type]
        None, description="how tool calls are read from the model's text; none: as the chat template writes them"
    )
    reasoning_parser: Literal[tuple(REASONING_PARSERS)] | None = Field(  # type: ignore[valid-type]
        None, description="splits <think>...</think> into reasoning_content; none: no reasoning parsed"
    )
    _template_text: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _read_template(self) -> ApiConfig:
        """A template file is read here, once, where the settings are validated: the replicas get its text."""
        value = self.chat_template
        if value is None or "{{" in value or "{%" in value:
            self._template_text = value
            return self
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
        self._template_text = path.read_text()
        return self

    @property
    def template_text(self) -> str | None:
        """The chat template's text (None: the model's own)."""
        return self._template_text


class AppConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="what to serve")
    engine: EngineSection = Field(default_factory=EngineSection, description="per-replica engine settings")
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeConfig, description="speculative decoding where requests decode (off by default)"
    )
    prefill: DeploymentConfig = Field(default_factory=DeploymentConfig, description="the prefill deployment")
    decode: DeploymentConfig = Field(default_factory=DeploymentConfig, description="the decode deployment")
    colocated: DeploymentConfig = Field(
        default_factory=lambda: DeploymentConfig(num_replicas=2),
        description="colocated_app: replicas doing both phases",
    )
    transport: TransportConfig = Field(default_factory=TransportConfig, description="KV transport")
    disagg_min_prompt_tokens: int = Field(
        0, ge=0, description="conditional disaggregation: shorter prompts are prefilled on the decode replica"
    )
    max_queued_requests: int = Field(256, ge=1, description="requests the ingress holds before answering 503")
    slo: SLOConfig = Field(
        default_factory=SLOConfig, description="service-level objectives (when set, in place of the policy's)"
    )
    autoscaling: AutoscalingSettings = Field(
        default_factory=AutoscalingSettings, description="disagg_app's elastic autoscaler (autoscaling/policies/)"
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="bounds on what one request may ask")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys on /v1 and /admin; none: open")
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig, description="failures before the first token")
    api: ApiConfig = Field(default_factory=ApiConfig, description="chat templates, tool-call and reasoning parsers")
    faults: list[FaultRule] = Field(
        default_factory=list, description="fault injection for failure rehearsals (kv_transport/faults.py); none"
    )

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.transport.kind == "object_store" and self.transport.mode == "push":
            raise ValueError("transport.mode=push needs transport.kind=nixl (the object store supports pull only)")
        if self.transport.kind == "object_store" and any(
            rule.point in (*TRANSPORT_POINTS, "release") for rule in self.faults
        ):
            raise ValueError("faults: transport fault points need transport.kind=nixl")
        engine = self.engine
        check_token_budget(
            engine.max_num_batched_tokens, engine.enable_chunked_prefill, self.model.max_model_len, "engine."
        )
        self._check_tensor_parallel()
        if self.disagg_min_prompt_tokens >= self.model.max_model_len:
            raise ValueError("disagg_min_prompt_tokens must be below model.max_model_len")
        if self.replica_scaling:
            self._check_scaling_bounds()
        return self

    def _check_tensor_parallel(self) -> None:
        """Tensor-parallel replicas move KV with NIXL between their pools (each rank its own heads)."""
        for home, name in POOL_SECTIONS.items():
            if self.pool(home).tensor_parallel_size == 1:
                continue
            if self.transport.kind != "nixl" or self.transport.staging != "none":
                raise ValueError(
                    f"{name}.tensor_parallel_size > 1 needs transport.kind=nixl and transport.staging=none "
                    f"(got {self.transport.kind}, {self.transport.staging})"
                )

    def pool(self, home: Role) -> DeploymentConfig:
        """The deployment section of the engine pool whose replicas start in ``home``:
        ``prefill``, ``decode``, or ``colocated`` for ``both``."""
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.BOTH: self.colocated}[home]

    @property
    def replica_scaling(self) -> bool:
        """disagg_app scales its pools' replica counts (autoscaling on, its policy's scaling on)."""
        settings = self.autoscaling
        return settings.enabled and settings.replica_scaling and settings.load().scaling.enabled

    def _check_scaling_bounds(self) -> None:
        scaling = self.autoscaling.load().scaling
        for pool in (Role.PREFILL, Role.DECODE):
            initial, bounds, name = self.pool(pool).num_replicas, scaling.pool(pool), POOL_SECTIONS[pool]
            if not bounds.min_replicas <= initial <= bounds.max_replicas:
                raise ValueError(
                    f"{name}.num_replicas ({initial}) must be within the autoscaling policy's"
                    f" scaling.{name} min_replicas..max_replicas ({bounds.min_replicas}..{bounds.max_replicas});"
                    " or autoscaling.replica_scaling=false for a fixed count"
                )

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
