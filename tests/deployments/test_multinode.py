"""Requests across Ray nodes: ``disagg_app`` on a three-node cluster on this machine
(``app.local_cluster``: a head, a ``prefill_node`` worker and a ``decode_node`` worker), with
the KV between the pools forced onto TCP (``UCX_TLS=tcp`` in both pools' replicas). It serves
the tiny model of tests/tiny_models.py, whose tokens change with any misplaced KV block.

One cluster serves both modes: pull first, then the application is redeployed in push mode,
with each pool asking for half of its node's resource (a fractional ``<pool>.resources``).
For each mode, one request through the HTTP API must give the engine's own greedy output
(one request at a time: token for token, tests/same_output.py's exact rule); the replicas
must sit on their own worker nodes, the ones Ray lists with the pool's resource; and the
prompt's KV must have crossed a TCP connection between the two replica processes. The last
point is read from the kernel (``ss -tinp``: bytes received per socket, with the owning
process): on one machine UCX would otherwise move the KV through shared memory (CMA), and no
KV-sized byte count would appear on any socket.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest
import ray
from ray import serve

from app.local_cluster import APP_NAME, POOL_RESOURCES, LocalCluster, deploy, local_cluster, pinned_args, ucx_args
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.params import SamplingParams
from tests.tiny_models import TINY_SERVED_NAME

PORT = 18445
MAX_TOKENS = 32
# 457 tokens (of the 512 context, 32 generated): 1.4 MB of KV (3,072 bytes per token in
# float32), far above any other traffic between the two replica processes
PROMPT = "The river ran past the old mill, and the miller counted the sacks of grain. " * 24
ARGS = {
    **ucx_args("tcp"),
    "model.max_model_len": "512",
    "engine.kv_cache_bytes": str(32 << 20),
    "autoscaling.enabled": "false",  # fixed pools, plain disaggregated routing
}
HALF_OF_EACH_NODE = {f"{pool}.resources": f"{{{resource}: 0.5}}" for pool, resource in POOL_RESOURCES.items()}
MODE_ARGS = {"pull": {}, "push": HALF_OF_EACH_NODE}


@dataclass(frozen=True)
class Served:
    """One mode's request and what the cluster says about it."""

    mode: str
    reply: dict
    prefill: dict  # EngineServer.model_info of each replica
    decode: dict
    last_pull: dict | None  # the decode replica's last pull (bytes, seconds); None in push


@dataclass(frozen=True)
class Socket:
    local: str
    peer: str
    pids: frozenset[int]
    bytes_received: int


@pytest.fixture(scope="module")
def cluster(own_cluster) -> Iterator[LocalCluster]:
    assert shutil.which("ss"), "this test reads TCP byte counts with `ss` (iproute2)"
    # TANDEM_KEEP_CLUSTER_LOGS=1 keeps the nodes' temp dirs (their logs) after the module
    with local_cluster(keep_logs=bool(os.environ.get("TANDEM_KEEP_CLUSTER_LOGS"))) as nodes:
        try:
            yield nodes
        finally:
            serve.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_served) -> dict:
    """The engine alone, in this process: the same model, prompt and greedy sampling."""
    core = EngineCore(tiny_served.loaded, EngineConfig(max_model_len=512, kv_cache_bytes=32 << 20))
    request = core.make_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    core.add_request(request)
    outputs = []
    while core.has_work():
        outputs.extend(core.step())
    return {
        "text": "".join(o.text for o in outputs),
        "prompt_tokens": len(request.prompt_token_ids),
        "kv_bytes_per_token": core.layout.bytes_per_token,
    }


@pytest.fixture(scope="module", params=["pull", "push"])
def served(request, cluster, tiny_served) -> Served:
    mode = request.param
    # replaces the previous mode's app
    args = {**ARGS, **tiny_served.args, **MODE_ARGS[mode], "transport.mode": mode}
    url = deploy(pinned_args(args), port=PORT)
    assert httpx.get(f"{url}/ready", timeout=30).json()["mode"] == f"disaggregated-{mode}"
    body = {"model": TINY_SERVED_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text

    def handle(name: str):
        return serve.get_deployment_handle(name, app_name=APP_NAME)

    last_pull = handle("DecodeServer").last_transfer.remote().result()
    info = {name: handle(name).model_info.remote().result() for name in ("PrefillServer", "DecodeServer")}
    return Served(mode, response.json(), info["PrefillServer"], info["DecodeServer"], last_pull)


def _pid(info: dict, deployment: str) -> int:
    """The replica's process: its engine id is ``<pool>-<pid>-<object id>`` (deployments/server.py),
    checked against the process's title, which Ray sets to the replica's actor."""
    pid = int(info["engine_id"].split("-")[1])
    title = " ".join(psutil.Process(pid).cmdline())
    assert f"ServeReplica:{APP_NAME}:{deployment}" in title, title
    return pid


def _tcp_sockets() -> list[Socket]:
    """Every TCP socket on the machine with its owning processes and bytes received, from
    ``ss -tinpH`` (each socket: a line with the endpoints and users, then its info line)."""
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    sockets = []
    for entry in re.split(r"\n(?=\S)", text.strip()):
        fields = entry.split()
        received = re.search(r"\bbytes_received:(\d+)", entry)
        pids = frozenset(int(p) for p in re.findall(r"pid=(\d+)", entry))
        sockets.append(Socket(fields[3], fields[4], pids, int(received.group(1)) if received else 0))
    return sockets


def _bytes_over_tcp(sender: int, receiver: int) -> int:
    """Bytes the ``receiver`` process received on TCP connections whose other end is a
    socket of the ``sender`` process."""
    sockets = _tcp_sockets()
    endpoints_of_sender = {s.local for s in sockets if sender in s.pids}
    return sum(s.bytes_received for s in sockets if receiver in s.pids and s.peer in endpoints_of_sender)


def test_same_output_as_the_engine_on_one_node(served, reference):
    (choice,) = served.reply["choices"]
    assert served.reply["usage"]["prompt_tokens"] == reference["prompt_tokens"]
    assert served.reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert choice["text"] == reference["text"], f"{served.mode}: {choice['text']!r} != {reference['text']!r}"


def test_each_pool_runs_on_its_own_worker_node(served, cluster):
    nodes = cluster.node_ids
    assert served.prefill["node_id"] == nodes["prefill_node"]
    assert served.decode["node_id"] == nodes["decode_node"]
    assert len({nodes["head"], served.prefill["node_id"], served.decode["node_id"]}) == 3


def test_each_pool_lands_on_the_node_ray_lists_with_its_resource(served):
    by_resource = {
        resource: node["NodeID"]
        for node in ray.nodes()
        if node["Alive"]
        for resource in POOL_RESOURCES.values()
        if resource in node["Resources"]
    }
    assert by_resource["prefill_node"] != by_resource["decode_node"]
    assert served.prefill["node_id"] == by_resource["prefill_node"]
    assert served.decode["node_id"] == by_resource["decode_node"]


def test_the_kv_crossed_over_tcp(served, reference):
    prefill = _pid(served.prefill, "PrefillServer")
    decode = _pid(served.decode, "DecodeServer")
    for pid in (prefill, decode):  # the pools' env_vars reached the replicas' processes
        assert psutil.Process(pid).environ().get("UCX_TLS") == "tcp"
    kv_bytes = reference["prompt_tokens"] * reference["kv_bytes_per_token"]
    if served.mode == "pull":  # the decode replica's own count of the bytes it read
        assert served.last_pull is not None and served.last_pull["bytes"] >= kv_bytes
        kv_bytes = served.last_pull["bytes"]
    received = _bytes_over_tcp(sender=prefill, receiver=decode)
    print(f"{served.mode}: KV {kv_bytes} bytes; over TCP from prefill pid {prefill} to decode pid {decode}: {received}")
    if served.last_pull:
        print(f"pull: {served.last_pull['bytes'] / served.last_pull['seconds'] / 1e9:.2f} GB/s")
    assert received >= kv_bytes, f"{served.mode}: {received} bytes over TCP from prefill to decode, KV is {kv_bytes}"


def test_env_vars_go_to_the_engine_replicas_runtime_env():
    """No cluster needed: the builder binds each pool with its ``env_vars`` as Ray's
    ``runtime_env``, and the ingress without."""
    from app.config import disagg_app

    ingress = disagg_app(pinned_args(ucx_args("tcp")))._bound_deployment
    pools = {name: ingress.init_kwargs[name]._bound_deployment for name in ("prefill", "decode")}
    for pool, deployment in pools.items():
        options = deployment.ray_actor_options
        assert options["runtime_env"] == {"env_vars": {"UCX_TLS": "tcp"}}, pool
        assert options["resources"] == {f"{pool}_node": 1}
    assert "runtime_env" not in ingress.ray_actor_options
