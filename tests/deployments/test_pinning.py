"""Pinning: each pool lands on the node group that carries its custom resource.

Ray here is a two-node ``cluster_utils`` cluster, not ``local_serve``'s single node: the
module starts it, and only running the application (and Serve's teardown) is shared.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from bench.ray_local import repo_on_pythonpath
from tests.serving import ServeApp, ServedApps, run_apps

PORT = 18432


@pytest.fixture(scope="module")
def two_nodes(own_cluster) -> Iterator[Cluster]:
    repo_on_pythonpath()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    with pytest.MonkeyPatch.context() as env:
        # Cluster writes its address file under Ray's default temp dir (/tmp/ray unless
        # RAY_TMPDIR is set), which a fresh machine does not have: keep it in ours
        env.setenv("RAY_TMPDIR", temp_dir)
        os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "resources": {"prefill_node": 1},
                "temp_dir": temp_dir,
                "include_dashboard": False,
            },
        )
        try:
            cluster.add_node(num_cpus=1, resources={"decode_node": 1})
            ray.init(address=cluster.address, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture(scope="module")
def pinned(two_nodes) -> Iterator[ServedApps]:
    from app.config import disagg_app

    args = {
        "model.max_model_len": "512",
        "engine.kv_cache_bytes": str(32 << 20),
        "prefill.num_cpus": "0.25",
        "decode.num_cpus": "0.25",
        "prefill.resources": "{prefill_node: 0.5}",
        "decode.resources": "{decode_node: 0.5}",
        "autoscaling.enabled": "false",
    }
    with run_apps([ServeApp("pinned", disagg_app, args)], port=PORT) as served:
        yield served


def _node_of(served: ServedApps, deployment: str) -> str:
    return served.handle(deployment, app="pinned").model_info.remote().result()["node_id"]


def test_each_pool_lands_on_its_node(pinned):
    by_resource = {
        name: node["NodeID"]
        for node in ray.nodes()
        if node["Alive"]
        for name in ("prefill_node", "decode_node")
        if name in node["Resources"]
    }
    assert by_resource["prefill_node"] != by_resource["decode_node"]
    assert _node_of(pinned, "PrefillServer") == by_resource["prefill_node"]
    assert _node_of(pinned, "DecodeServer") == by_resource["decode_node"]
