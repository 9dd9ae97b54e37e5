"""The shipped Serve config and KubeRay RayServices (GPU, CPU, tensor-parallel decode): Serve's
schema accepts them, their application settings are a valid AppConfig that builds the
application, and each pool's pinning resource is offered by exactly one node group, with room
for its replicas (a tensor-parallel replica's ranks within one pod)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from app.config import AppConfig, disagg_app
from tests.deploy.test_autoscaling_manifest import WORKER_GROUP_FIELDS, WORKER_GROUP_REQUIRED

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAYSERVICES = ["kuberay/rayservice.yaml", "kuberay/rayservice-cpu.yaml", "kuberay/rayservice-tp.yaml"]


def _serve_config(name: str) -> dict:
    data = yaml.safe_load((DEPLOY / name).read_text())
    if data.get("kind") == "RayService":
        data = yaml.safe_load(data["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(data)
    return data


def _rayservice(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _offered(group: dict) -> dict[str, float]:
    """Custom resources a KubeRay group's ``ray start`` offers (a JSON string in quotes)."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(raw.strip('"').replace('\\"', '"')) if raw else {}


@pytest.mark.parametrize("name", ["serve_config.yaml", *RAYSERVICES])
def test_shipped_configs_build_the_application(name):
    (application,) = _serve_config(name)["applications"]
    assert application["import_path"] == "app.config:disagg_app"
    config = AppConfig.load(application["args"], environ={})
    assert set(config.prefill.resources).isdisjoint(config.decode.resources), "pools share a pinning resource"
    assert config.prefill.resources and config.decode.resources
    app = disagg_app(application["args"])  # binds the three deployments without starting them
    assert app._bound_deployment.name == "OpenAIIngress"


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_pins_each_pool_to_its_own_worker_group(name):
    service = _rayservice(name)
    cluster = service["spec"]["rayClusterConfig"]
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    config = AppConfig.load(application["args"], environ={})
    head = cluster["headGroupSpec"]
    # the head takes no engine replica, and has room for the ingress (the workers' CPUs
    # go to replicas, checked below)
    assert not _offered(head)
    ingress = disagg_app(application["args"])._bound_deployment
    assert float(head["rayStartParams"]["num-cpus"]) >= ingress.ray_actor_options["num_cpus"]
    image = head["template"]["spec"]["containers"][0]["image"]
    for pool_name, pool in (("prefill", config.prefill), ("decode", config.decode)):
        (resource,) = pool.resources
        groups = [g for g in cluster["workerGroupSpecs"] if resource in _offered(g)]
        assert [g["groupName"] for g in groups] == [pool_name]
        group = groups[0]
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == image
        # each rank (one placement-group bundle; the replica itself without tensor parallelism)
        # asks for the pool's resources: a pod holds whole replicas' ranks
        ranks = _offered(group)[resource] / pool.resources[resource]
        per_pod, tp = ranks // pool.tensor_parallel_size, pool.tensor_parallel_size
        assert per_pod >= 1 and per_pod * tp == ranks, f"{pool_name}: {ranks} ranks per pod, {tp} per replica"
        gpus = float(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        assert ranks * pool.num_gpus == gpus, f"{pool_name}: {ranks} ranks per pod x {pool.num_gpus} GPUs"
        assert float(group["rayStartParams"].get("num-gpus", gpus)) == gpus
        assert ranks * pool.num_cpus <= float(container["resources"]["limits"]["cpu"])
        assert per_pod * group["maxReplicas"] >= pool.num_replicas
        if config.model.source != "default":  # the default model is in the image (deploy/Dockerfile)
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert config.model.source.startswith(tuple(m + "/" for m in mounts)), "the model must be on a volume"
    assert cluster["rayVersion"] in (DEPLOY / "Dockerfile").read_text()


@pytest.mark.parametrize("name", RAYSERVICES)
def test_worker_groups_use_only_the_crds_fields(name):
    """KubeRay's CRD (tests/deploy/test_autoscaling_manifest.py): the worker group fields,
    string rayStartParams, and replicas within their bounds."""
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams are strings"
    for group in cluster["workerGroupSpecs"]:
        assert WORKER_GROUP_REQUIRED <= set(group) <= WORKER_GROUP_FIELDS
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def _bound_decode(args: dict):
    """The decode deployment ``disagg_app`` binds (without starting it)."""
    ingress = disagg_app(args)._bound_deployment
    (decode,) = [
        c._bound_deployment for c in ingress.init_kwargs.values() if c and "Decode" in c._bound_deployment.name
    ]
    return decode


def test_tensor_parallel_rayservice_packs_each_decode_replica_into_one_pod():
    """rayservice-tp.yaml: decode replicas of 2 ranks (one GPU each), KV by pull; a decode pod's
    GPUs are exactly one replica's (tensor_parallel_size x num_gpus), so the replica's
    STRICT_PACK placement group (one bundle per rank) fits one pod, and only a decode pod."""
    service = _rayservice("kuberay/rayservice-tp.yaml")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    config = AppConfig.load(application["args"], environ={})
    decode = config.decode
    assert (decode.tensor_parallel_size, decode.num_gpus, config.prefill.tensor_parallel_size) == (2, 1, 1)
    assert (config.transport.kind, config.transport.mode) == ("nixl", "pull")
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    group = groups["decode"]
    (container,) = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == decode.tensor_parallel_size * decode.num_gpus == int(group["rayStartParams"]["num-gpus"])
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm"}, "NCCL's shared memory"
    bound = _bound_decode(application["args"])._replica_config
    assert bound.placement_group_strategy == "STRICT_PACK"
    assert _bound_decode(application["args"])._deployment_config.health_check_period_s == 2.0  # a lost rank
    assert len(bound.placement_group_bundles) == decode.tensor_parallel_size
    pod = {"GPU": gpus, "CPU": float(container["resources"]["limits"]["cpu"]), **_offered(group)}
    for resource in {r for bundle in bound.placement_group_bundles for r in bundle}:
        asked = sum(bundle.get(resource, 0) for bundle in bound.placement_group_bundles)
        assert asked <= pod.get(resource, 0), f"{resource}: {asked} asked, a decode pod has {pod.get(resource, 0)}"
    for name, other in groups.items():
        assert name == "decode" or "decode_node" not in _offered(other)
    assert group["replicas"] >= decode.num_replicas, "one replica per pod: a pod for each at start"


def test_cpu_rayservice_needs_no_gpu_and_no_volume():
    """What kind or minikube on a laptop offers: CPUs only, the image's default model, small
    requests; the groups use only fields KubeRay's CRD has (tests/deploy/test_autoscaling_manifest.py)."""
    service = _rayservice("kuberay/rayservice-cpu.yaml")
    assert "nvidia.com/gpu" not in json.dumps(service)
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    config = AppConfig.load(application["args"], environ={})
    assert (config.model.source, config.model.device) == ("default", "cpu")
    assert config.prefill.num_gpus == config.decode.num_gpus == 0
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    requested = 0.0
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"].endswith("-cpu"), "the image built with --build-arg DEVICE=cpu"
        assert "volumeMounts" not in container and "volumes" not in group["template"]["spec"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams are strings"
        requested += float(container["resources"]["requests"]["cpu"])
    assert requested <= 4, "fits a 4-core laptop"
    for group in cluster["workerGroupSpecs"]:
        assert WORKER_GROUP_REQUIRED <= set(group) <= WORKER_GROUP_FIELDS
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
