"""Bind the deployments of an application from a validated ``AppConfig``.

The deployments get the validated ``AppConfig`` itself (Ray pickles it with the policy it
loaded), so the settings are validated once, here at the edge.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from app.settings import AppConfig, DeploymentConfig
from autoscaling.serve_policy import serve_autoscaling_config
from deployments.controller import AutoscalerController
from deployments.ingress import OpenAIIngress
from deployments.server import EngineServer
from engine.params import Role

ROUTER = "deployments.router.RoleAwareRouter"
ROUTING_STATS_PERIOD_S = 0.5
INGRESS_SPARE = 16  # room above max_queued_requests so the ingress itself answers 503
# Serve learns that a replica died (SIGKILL, OOM) only from its next health check: with Serve's
# default period (10 s) a dead replica was replaced up to 10 s late. Checks are cheap here
# (EngineServer.check_health runs no engine work; the others are Serve's liveness call).
HEALTH_CHECK_PERIOD_S = 2.0
DRAIN_MARGIN_S = 5.0  # a stopping replica's graceful bound: its KV lease plus this
# a stopping replica looks for requests still in flight this often; Serve sleeps once before
# the first look, so its default (2 s) made every stop (scale-down, redeploy) take 2 s or more
STOP_POLL_S = 0.25
# the Serve options every deployment of an application takes (engine pools, ingress, controller)
EVERY_DEPLOYMENT = {"graceful_shutdown_wait_loop_s": STOP_POLL_S, "health_check_period_s": HEALTH_CHECK_PERIOD_S}


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
        **_tensor_parallel_options(deployment),
        max_ongoing_requests=deployment.max_ongoing_requests,
        **EVERY_DEPLOYMENT,
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


def _tensor_parallel_options(deployment: DeploymentConfig) -> dict[str, Any]:
    """A tensor-parallel replica: one bundle per rank (the replica itself is bundle 0), all on
    one node (the ranks meet on the loopback; NCCL wants one host). A lost rank fails the
    replica's health check (every ``HEALTH_CHECK_PERIOD_S``), and Serve replaces the group."""
    if deployment.tensor_parallel_size == 1:
        return {}
    return {
        "placement_group_bundles": [deployment.bundle()] * deployment.tensor_parallel_size,
        "placement_group_strategy": "STRICT_PACK",
    }


def _ingress(config: AppConfig):
    # Serve's default bound (5 requests in flight per replica) would queue streams in the
    # proxy; the ingress holds up to max_queued_requests itself and answers 503 beyond.
    return serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=config.max_queued_requests + INGRESS_SPARE,
        **EVERY_DEPLOYMENT,
    )


def _controller():
    # the ingress's syncs and every engine replica's reports come several times a second:
    # no access-log line per call (the controller logs its decisions itself)
    return serve.deployment(
        AutoscalerController,
        name="AutoscalerController",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0.05},
        logging_config=LoggingConfig(enable_access_log=False),
        **EVERY_DEPLOYMENT,
    )


def _scaling_options(config: AppConfig, pool: Role) -> dict[str, Any] | None:
    """With replica scaling on: the pool's Serve autoscaling config, following the
    controller's decision, and a graceful-stop bound that covers the drain."""
    if not config.replica_scaling:
        return None
    policy = config.autoscaling.load(config.slo.ttft_ms, config.slo.tpot_ms)
    initial = config.pool(pool).num_replicas
    return {
        "autoscaling_config": serve_autoscaling_config(policy, pool, initial),
        "graceful_shutdown_timeout_s": policy.scaling.graceful_shutdown_timeout_s,
    }


def _engine_pool(name: str, config: AppConfig, home: Role, controller: Any = None):
    scaling = _scaling_options(config, home) if home is not Role.BOTH else None
    deployment = _engine_deployment(name, config.pool(home), config, scaling)
    return deployment.bind(config, home, controller=controller)


def build_disagg(config: AppConfig) -> serve.Application:
    controller = _controller().bind(config) if config.autoscaling.enabled else None
    prefill = _engine_pool("PrefillServer", config, Role.PREFILL, controller)
    decode = _engine_pool("DecodeServer", config, Role.DECODE, controller)
    return _ingress(config).bind(config, prefill=prefill, decode=decode, controller=controller)


def build_colocated(config: AppConfig) -> serve.Application:
    colocated = _engine_pool("ColocatedServer", config, Role.BOTH)
    return _ingress(config).bind(config, colocated=colocated)
