"""Bind the deployments of an application from a validated ``AppConfig``."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.settings import AppConfig, DeploymentConfig
from autoscaling.serve_policy import serve_autoscaling_config
from deployments.ingress import OpenAIIngress
from deployments.server import EngineServer
from engine.params import Role

ROUTER = "deployments.router.RoleAwareRouter"
ROUTING_STATS_PERIOD_S = 0.5
INGRESS_SPARE = 16  # room above max_queued_requests so the ingress itself answers 503
DRAIN_MARGIN_S = 5.0  # a stopping replica's graceful bound: its KV lease plus this


def _engine_deployment(
    name: str, deployment: DeploymentConfig, config: AppConfig, scaling: dict[str, Any] | None = None
):
    """``scaling``: Serve options for replica scaling (``_scaling_options``), else a fixed count.
    A stopping replica (scale-down, redeploy, shutdown) keeps its exported KV until fetched or
    its lease ends (``EngineServer.__del__``): Serve's graceful-stop bound covers that wait."""
    options = dict(scaling or {"num_replicas": deployment.num_replicas})
    drain_s = config.transport.kv_transfer_timeout_s + DRAIN_MARGIN_S
    options["graceful_shutdown_timeout_s"] = max(options.get("graceful_shutdown_timeout_s", 0.0), drain_s)
    return serve.deployment(
        EngineServer,
        name=name,
        **options,
        ray_actor_options=_actor_options(deployment),
        max_ongoing_requests=deployment.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S
        ),
    )


def _actor_options(deployment: DeploymentConfig) -> dict[str, Any]:
    """The pool's Ray actor options; its ``env_vars`` go in through Ray's ``runtime_env``
    (e.g. ``UCX_TLS=tcp``: UCX reads its settings when NIXL starts, inside the replica)."""
    options = deployment.ray_actor_options()
    if deployment.env_vars:
        options["runtime_env"] = {"env_vars": dict(deployment.env_vars)}
    return options


def _ingress(config: AppConfig):
    # Serve's default bound (5 requests in flight per replica) would queue streams in the
    # proxy; the ingress holds up to max_queued_requests itself and answers 503 beyond.
    return serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=config.max_queued_requests + INGRESS_SPARE,
    )


def _controller():
    from autoscaling.controller import AutoscalerController

    return serve.deployment(
        AutoscalerController, name="AutoscalerController", num_replicas=1, ray_actor_options={"num_cpus": 0.05}
    )


def _scaling_options(config: AppConfig, pool: str) -> dict[str, Any] | None:
    """With replica scaling on: the pool's Serve autoscaling config, following the
    controller's decision, and a graceful-stop bound that covers the drain."""
    if not config.replica_scaling:
        return None
    policy = config.autoscaling.load(config.slo.ttft_ms, config.slo.tpot_ms)
    initial = getattr(config, pool).num_replicas
    return {
        "autoscaling_config": serve_autoscaling_config(policy, pool, initial),
        "graceful_shutdown_timeout_s": policy.scaling.graceful_shutdown_timeout_s,
    }


def build_disagg(config: AppConfig) -> serve.Application:
    data = config.model_dump()
    controller = _controller().bind(data) if config.autoscaling.enabled else None
    prefill = _engine_deployment("PrefillServer", config.prefill, config, _scaling_options(config, "prefill")).bind(
        data, Role.PREFILL.value, "prefill", controller=controller
    )
    decode = _engine_deployment("DecodeServer", config.decode, config, _scaling_options(config, "decode")).bind(
        data, Role.DECODE.value, "decode", controller=controller
    )
    return _ingress(config).bind(data, prefill=prefill, decode=decode, controller=controller)


def build_colocated(config: AppConfig) -> serve.Application:
    data = config.model_dump()
    colocated = _engine_deployment("ColocatedServer", config.colocated, config).bind(data, Role.BOTH.value, "colocated")
    return _ingress(config).bind(data, colocated=colocated)
