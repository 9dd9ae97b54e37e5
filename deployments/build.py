"""Bind the deployments of an application from a validated ``AppConfig``."""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.settings import AppConfig, DeploymentConfig
from deployments.ingress import OpenAIIngress
from deployments.server import EngineServer
from engine.params import Role

ROUTER = "deployments.router.RoleAwareRouter"
ROUTING_STATS_PERIOD_S = 0.5
INGRESS_SPARE = 16  # room above max_queued_requests so the ingress itself answers 503


def _engine_deployment(name: str, deployment: DeploymentConfig):
    return serve.deployment(
        EngineServer,
        name=name,
        num_replicas=deployment.num_replicas,
        ray_actor_options=deployment.ray_actor_options(),
        max_ongoing_requests=deployment.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S
        ),
    )


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


def build_disagg(config: AppConfig) -> serve.Application:
    data = config.model_dump()
    controller = _controller().bind(data) if config.autoscaling.enabled else None
    prefill = _engine_deployment("PrefillServer", config.prefill).bind(
        data, Role.PREFILL.value, "prefill", controller=controller
    )
    decode = _engine_deployment("DecodeServer", config.decode).bind(
        data, Role.DECODE.value, "decode", controller=controller
    )
    return _ingress(config).bind(data, prefill=prefill, decode=decode, controller=controller)


def build_colocated(config: AppConfig) -> serve.Application:
    data = config.model_dump()
    colocated = _engine_deployment("ColocatedServer", config.colocated).bind(data, Role.BOTH.value, "colocated")
    return _ingress(config).bind(data, colocated=colocated)
