"""deploy/kuberay/rayservice-autoscaling.yaml, checked without a cluster: Serve's schema and
AppConfig accept its application, the engine deployments' Serve options are the ones the
builder derives from the policy (the YAML's replace the builder's, so they must agree), and
each pool's worker group, as Ray's own autoscaler reads it, can hold the pool's replicas from
the policy's min to its max. KubeRay's CRD is not vendored here: the fields this manifest
uses are checked against the CRD's enums and types and against KubeRay's validation rules
(ray-operator/controllers/ray/utils/validation.go), both read at kuberay commit feeaf72."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.autoscaler._private import constants as autoscaler_constants
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.autoscaler.v2.instance_manager import config as autoscaler_v2_config
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
from ray.serve.schema import ServeDeploySchema

from app.config import AppConfig, disagg_app
from autoscaling.policy import Policy, load_policy
from autoscaling.serve_policy import serve_autoscaling_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFEST = DEPLOY / "kuberay" / "rayservice-autoscaling.yaml"
POOLS = {"prefill": "PrefillServer", "decode": "DecodeServer"}

# From KubeRay's CRD (ray.io_rayservices.yaml, rayClusterConfig): what the API server accepts.
AUTOSCALER_OPTIONS = {
    "args", "command", "env", "envFrom", "idleTimeoutSeconds", "image", "imagePullPolicy",
    "resources", "securityContext", "upscalingMode", "version", "volumeMounts",
}  # fmt: skip
UPSCALING_MODES = {"Default", "Aggressive", "Conservative"}
WORKER_GROUP_FIELDS = {
    "groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas", "numOfHosts",
    "priority", "rayStartParams", "replicas", "resources", "scaleStrategy", "suspend", "template",
}  # fmt: skip
WORKER_GROUP_REQUIRED = {"groupName", "maxReplicas", "minReplicas", "template"}


def _service() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def _cluster() -> dict[str, Any]:
    return _service()["spec"]["rayClusterConfig"]


def _serve_config() -> dict[str, Any]:
    return yaml.safe_load(_service()["spec"]["serveConfigV2"])


def _application() -> dict[str, Any]:
    (application,) = _serve_config()["applications"]
    return application


def _config() -> AppConfig:
    return AppConfig.load(_application()["args"], environ={})


def _policy() -> Policy:
    return load_policy(_config().autoscaling.policy)


def _options(name: str) -> dict[str, Any]:
    """The manifest's Serve options for one deployment."""
    (options,) = [d for d in _application()["deployments"] if d["name"] == name]
    return options


def _bound_deployments() -> dict[str, Any]:
    """The deployments ``disagg_app`` binds (without starting them), by name."""
    ingress = disagg_app(_application()["args"])._bound_deployment
    bound = {ingress.name: ingress}
    for child in ingress.init_kwargs.values():
        if child is not None:
            bound[child._bound_deployment.name] = child._bound_deployment
    return bound


def _node_types() -> dict[str, dict[str, Any]]:
    """The node types Ray's autoscaler derives from the RayCluster spec (the code the
    autoscaler sidecar runs on the head)."""
    ray_cluster = {"metadata": {"name": "tandem-autoscaling", "namespace": "default"}, "spec": _cluster()}
    return _derive_autoscaling_config_from_ray_cr(ray_cluster)["available_node_types"]


def _fits(node: dict[str, float], demand: dict[str, float]) -> int:
    """How many of ``demand`` one node of this type holds."""
    return min(math.floor(node.get(name, 0) / amount + 1e-9) for name, amount in demand.items() if amount)


def test_the_application_is_valid_and_binds():
    ServeDeploySchema.model_validate(_serve_config())
    application = _application()
    assert application["import_path"] == "app.config:disagg_app"
    config = _config()
    assert config.autoscaling.enabled and config.replica_scaling
    bound = _bound_deployments()
    assert set(bound) == {"OpenAIIngress", "AutoscalerController", *POOLS.values()}
    # Serve refuses an override naming a deployment the application does not have
    assert {d["name"] for d in application["deployments"]} <= set(bound)


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_engine_deployments_follow_the_policy_as_the_builder_does(pool):
    config, policy = _config(), _policy()
    bounds = getattr(policy.scaling, pool)
    options = _options(POOLS[pool])
    written = options["autoscaling_config"]
    assert "num_replicas" not in options, "a fixed num_replicas next to autoscaling_config is refused by Serve"
    assert (written["min_replicas"], written["max_replicas"]) == (bounds.min_replicas, bounds.max_replicas)
    assert written == serve_autoscaling_config(policy, pool, getattr(config, pool).num_replicas)
    assert options["graceful_shutdown_timeout_s"] == policy.scaling.graceful_shutdown_timeout_s
    # Serve replaces the builder's whole autoscaling_config with the YAML's (fields left out
    # fall back to Serve's defaults), so the two must be the same config
    built = _bound_deployments()[POOLS[pool]]._deployment_config
    assert AutoscalingConfig(**written).model_dump() == built.autoscaling_config.model_dump()
    assert built.graceful_shutdown_timeout_s == options["graceful_shutdown_timeout_s"]
    assert AutoscalingConfig(**written).policy.get_policy().__name__ == "follow_decision"  # it imports


def test_application_level_alternative_validates():
    """docs/deploy.md's alternative: the application-level policy, the same per-deployment
    bounds kept (Serve registers only deployments that have an autoscaling_config)."""
    policy = AutoscalingPolicy(policy_function="autoscaling.serve_policy:follow_decisions")
    assert policy.get_policy().__name__ == "follow_decisions"
    serve_config = _serve_config()
    serve_config["applications"][0]["autoscaling_policy"] = {"policy_function": policy.policy_function}
    ServeDeploySchema.model_validate(serve_config)


def test_ingress_and_controller_keep_the_builders_options_pinned_to_the_head():
    """Serve replaces a deployment's ray_actor_options with the YAML's: they must be the
    builder's plus the head's pinning resource, and the head must hold both."""
    bound, node_types = _bound_deployments(), _node_types()
    demand: dict[str, float] = {}
    for name in ("OpenAIIngress", "AutoscalerController"):
        written = dict(_options(name)["ray_actor_options"])
        pinned = written.pop("resources")
        assert written == bound[name]._replica_config.ray_actor_options
        assert set(pinned) == {"tandem_head"}
        for resource, amount in {"CPU": written["num_cpus"], **pinned}.items():
            demand[resource] = demand.get(resource, 0) + amount
    head = node_types.pop("headgroup")["resources"]
    assert all(head.get(resource, 0) >= amount for resource, amount in demand.items()), (demand, head)
    assert not any("tandem_head" in node["resources"] for node in node_types.values())


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_each_pool_has_its_own_worker_group_sized_by_the_policy(pool):
    """The pool's replicas fit only its group, whose minReplicas hold Serve's min (and no more)
    and whose maxReplicas hold Serve's max, one replica per GPU."""
    cluster, config, policy = _cluster(), _config(), _policy()
    assert cluster["enableInTreeAutoscaling"] is True
    settings, bounds = getattr(config, pool), getattr(policy.scaling, pool)
    demand = {"CPU": settings.num_cpus, "GPU": settings.num_gpus, **settings.resources}
    node_types = _node_types()
    (pinning,) = settings.resources
    assert [name for name, node in node_types.items() if pinning in node["resources"]] == [pool]
    assert [name for name, node in node_types.items() if _fits(node["resources"], demand)] == [pool]
    node = node_types[pool]
    per_pod = _fits(node["resources"], demand)
    assert per_pod >= 1
    assert per_pod * settings.num_gpus == node["resources"]["GPU"], "a GPU no replica uses"
    assert node["min_workers"] == math.ceil(bounds.min_replicas / per_pod), "min pods must hold Serve's min, no more"
    assert node["max_workers"] * per_pod >= bounds.max_replicas, "max pods must hold Serve's max"
    (group,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == pool]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["replicas"] * per_pod >= settings.num_replicas  # Serve's initial replicas have pods at start


def test_pods_image_model_volume_and_ray_version():
    cluster, config = _cluster(), _config()
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == head["image"]
        assert container["resources"]["requests"] == container["resources"]["limits"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert config.model.source.startswith(tuple(m + "/" for m in mounts)), "the model must be on a mounted volume"
    assert cluster["rayVersion"] == ray.__version__
    assert f"rayproject/ray:{cluster['rayVersion']}" in (DEPLOY / "Dockerfile").read_text()


def test_kuberay_accepts_the_cluster_spec():
    """The CRD's fields and enums, and the rules of KubeRay's ValidateRayClusterSpec that
    concern autoscaling."""
    cluster = _cluster()
    options = cluster["autoscalerOptions"]
    assert set(options) <= AUTOSCALER_OPTIONS
    assert options["upscalingMode"] in UPSCALING_MODES and options["version"] in {"v1", "v2"}
    assert isinstance(options["idleTimeoutSeconds"], int) and options["idleTimeoutSeconds"] >= 0
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    head_env = {e["name"] for e in head_pod["containers"][0].get("env", [])}
    assert "RAY_enable_autoscaler_v2" not in head_env, "KubeRay refuses both version and the env var"
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams are strings"
        assert group["template"]["spec"].get("restartPolicy", "Never") == "Never", "autoscaler v2 needs Never"
    for group in cluster["workerGroupSpecs"]:
        assert WORKER_GROUP_REQUIRED <= set(group) <= WORKER_GROUP_FIELDS
        assert 0 <= group["minReplicas"] <= group["maxReplicas"]
        assert not group.get("suspend"), "KubeRay refuses a suspended group with the autoscaler on"


def test_autoscaler_env_names_are_ones_ray_reads():
    """A misspelt variable would be ignored silently: each must appear in the installed Ray's
    autoscaler (the sidecar runs the same Ray, the image's)."""
    source = inspect.getsource(autoscaler_constants) + inspect.getsource(autoscaler_v2_config)
    for entry in _cluster()["autoscalerOptions"].get("env", []):
        assert f'"{entry["name"]}"' in source, entry["name"]
        json.loads(entry["value"])  # a number, as Ray's env_integer parses it
