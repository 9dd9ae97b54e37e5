"""Bind the deployments of an application from a validated ``AppConfig``."""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.config import AppConfig, PoolConfig
from deployments.ingress import OpenAIIngress
from deployments.server import EngineServer

ROUTER = "deployments.router.RoleAwareRouter"
ROUTING_STATS_PERIOD_S = 0.5


def _engine_deployment(name: str, pool: PoolConfig):
    return serve.deployment(
        EngineServer,
        name=name,
        num_replicas=pool.num_replicas,
        ray_actor_options=pool.ray_actor_options(),
        max_ongoing_requests=pool.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S
        ),
    )


def _ingress():
    return serve.deployment(OpenAIIngress, name="OpenAIIngress", num_replicas=1, ray_actor_options={"num_cpus": 0.1})


def build_disagg(config: AppConfig) -> serve.Application:
    data = config.model_dump()
    prefill = _engine_deployment("PrefillServer", config.prefill).bind(data, "prefill", "prefill")
    decode = _engine_deployment("DecodeServer", config.decode).bind(data, "decode", "decode")
    return _ingress().bind(data, prefill=prefill, decode=decode)


def build_colocated(config: AppConfig) -> serve.Application:
    data = config.model_dump()
    colocated = _engine_deployment("ColocatedServer", config.colocated).bind(data, "both", "colocated")
    return _ingress().bind(data, colocated=colocated)
