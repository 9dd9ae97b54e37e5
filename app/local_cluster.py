"""Multi-node serving on one machine: a Ray head and two worker nodes, each pool pinned to one.

The head offers no engine resources (the Serve controller, its HTTP proxy, the ingress and
the autoscaler controller run there or anywhere); one worker node offers ``prefill_node``,
the other ``decode_node``, and ``disagg_app`` is deployed with ``prefill.resources`` /
``decode.resources`` asking for them, so a request's KV crosses Ray nodes as it would
between machines. Each node has its own temp dir and ports (``ray.cluster_utils.Cluster``),
and the teardown stops exactly the processes started here, never ``ray stop``.

Command line (serves until Ctrl-C, then stops the three nodes)::

    python -m app.local_cluster up                                   # on http://127.0.0.1:8000
    python -m app.local_cluster up --ucx-tls tcp transport.mode=push # KV over TCP, not shared memory

In Python (what tests/deployments/test_multinode.py does)::

    with local_cluster() as nodes:
        url = deploy(pinned_args({"transport.mode": "push"}), port=8000)

One node, for tests and benchmarks: ``start_local_ray`` / ``stop_local_ray`` (own temp dir,
this checkout importable), and ``Server``, one Serve application in a local Ray of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from app.settings import AppConfig

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
APP_NAME = "tandem"
POOL_RESOURCES = {"prefill": "prefill_node", "decode": "decode_node"}
HEAD_CPUS = 1  # logical CPUs: the ingress (0.1) and the autoscaler controller (0.05)
WORKER_CPUS = 1  # logical CPUs per worker node; replicas ask for 0.5 by default
READY_TIMEOUT_S = 240.0
HTTP_PORT = 18480  # Server's
METRICS_PORT = 18490  # + the server's index: a fresh cluster's metrics never mix with the last one's
_TEMP_DIRS: list[str] = []  # of the one-node clusters this process started: stop_local_ray removes them


def start_local_ray(num_cpus: int = 2, **kwargs) -> None:
    """``kwargs`` go to ``ray.init`` (e.g. ``object_store_memory``, ``_metrics_export_port``). Workers
    inherit the driver's environment: this checkout goes on ``PYTHONPATH`` so they import its packages."""
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    _TEMP_DIRS.append(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=_TEMP_DIRS[-1], log_to_driver=False, **kwargs)


def stop_local_ray(keep_logs: bool = False) -> None:
    """Ray down, then the temp dirs (sockets and logs) of the clusters started here removed,
    unless ``keep_logs``."""
    ray.shutdown()
    while _TEMP_DIRS:
        temp_dir = _TEMP_DIRS.pop()
        if not keep_logs:
            shutil.rmtree(temp_dir, ignore_errors=True)


class Server:
    """One Serve application (``colocated``: colocated_app, ``disagg``: disagg_app, with ``args``)
    in its own local Ray cluster, stopped on exit, its logs then copied to ``keep_logs``;
    ``metrics_url``: Ray's Prometheus export of this cluster."""

    def __init__(self, application: str, args: dict[str, str], index: int = 0, *, name: str = "bench",
                 keep_logs: Path | None = None, port: int = HTTP_PORT) -> None:  # fmt: skip
        self.application, self.args, self.index, self.name = application, dict(args), index, name
        self.keep_logs, self.port, self.log_dir = keep_logs, port, None
        self.url, self.metrics_url = f"http://{HOST}:{port}", f"http://{HOST}:{METRICS_PORT + index}/metrics"

    def __enter__(self) -> Server:
        from app.config import colocated_app, disagg_app

        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C and SIGTERM end the run
        signal.signal(signal.SIGTERM, _exit_on_signal)  # ... and stop this cluster in __exit__
        start_local_ray(_metrics_export_port=METRICS_PORT + self.index,
                        _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
        self.log_dir = _logs_dir()
        try:
            serve.start(http_options={"host": HOST, "port": self.port})
            builder = colocated_app if self.application == "colocated" else disagg_app
            serve.run(builder(dict(self.args)), name=self.name, route_prefix="/")
            _wait_ready(self.url, READY_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def __exit__(self, *exc) -> None:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        if self.keep_logs is not None and self.log_dir is not None:
            shutil.rmtree(self.keep_logs, ignore_errors=True)
            shutil.copytree(self.log_dir, self.keep_logs, ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
        stop_local_ray()
        time.sleep(2)


def serve_logs(log_dir: Path) -> list[Path]:
    """A Ray session's Serve logs, then its workers' stderr."""
    return sorted(log_dir.glob("serve/*.log")) + sorted(log_dir.glob("worker-*.err"))


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def _logs_dir() -> Path | None:
    """This Ray session's log folder (a private Ray call: None where it moved)."""
    with contextlib.suppress(AttributeError, ImportError):
        from ray._private import worker

        return Path(worker._global_node.get_logs_dir_path())
    return None


@dataclass(frozen=True)
class LocalCluster:
    """The running cluster: ``node_ids`` maps ``head`` / ``prefill_node`` / ``decode_node``
    to Ray node ids; ``temp_dir`` holds each node's temp dir (logs under ``<node>/session_latest``)."""

    cluster: Cluster
    temp_dir: Path
    node_ids: dict[str, str]


@contextmanager
def _environment(temp_dir: Path) -> Iterator[None]:
    """Set while the nodes start and run, restored after. ``RAY_TMPDIR``: Cluster writes the
    cluster's address file under Ray's default temp dir (/tmp/ray unless set), shared with
    any other Ray on the machine; keep it in ours. ``PYTHONPATH``: the nodes' workers inherit
    it and import this checkout."""
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "PYTHONPATH")}
    os.environ["RAY_TMPDIR"] = str(temp_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    (temp_dir / "ray").mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start(temp_dir: Path, worker_resources: Mapping[str, float], worker_cpus: float) -> LocalCluster:
    """The head, then one worker node per pool resource; the caller shuts it down."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": HEAD_CPUS, "temp_dir": str(temp_dir / "head"), "include_dashboard": False},
    )
    ids = {"head": cluster.head_node.node_id}
    try:
        for resource, amount in worker_resources.items():
            node = cluster.add_node(
                num_cpus=worker_cpus, resources={resource: amount}, temp_dir=str(temp_dir / resource)
            )
            ids[resource] = node.node_id
    except BaseException:
        cluster.shutdown()
        raise
    return LocalCluster(cluster, temp_dir, ids)


@contextmanager
def local_cluster(
    prefill_slots: float = 1, decode_slots: float = 1, worker_cpus: float = WORKER_CPUS, keep_logs: bool = False
) -> Iterator[LocalCluster]:
    """Start the three nodes and connect this process (``ray.init``); on exit disconnect and
    stop them. ``*_slots``: how much of its pool resource each worker offers (replicas that
    fit, as ``pinned_args`` has each replica ask for 1). The temp dirs (the nodes' logs) are
    removed after a clean exit, and kept after an error or with ``keep_logs``."""
    temp_dir = Path(tempfile.mkdtemp(prefix="tandem-cluster-", dir="/tmp"))
    resources = {POOL_RESOURCES["prefill"]: prefill_slots, POOL_RESOURCES["decode"]: decode_slots}
    with _environment(temp_dir):
        nodes = _start(temp_dir, resources, worker_cpus)
        try:
            ray.init(address=nodes.cluster.address, log_to_driver=False)
            yield nodes
        finally:
            ray.shutdown()
            nodes.cluster.shutdown()
    if not keep_logs:
        shutil.rmtree(temp_dir, ignore_errors=True)


def pinned_args(args: Mapping[str, str] | None = None) -> dict[str, str]:
    """``disagg_app`` arguments that pin each pool to its worker node; ``args`` win. Fixed
    pools by default: each worker holds the replicas its slots allow, no more."""
    pinned = {
        "prefill.resources": f"{{{POOL_RESOURCES['prefill']}: 1}}",
        "decode.resources": f"{{{POOL_RESOURCES['decode']}: 1}}",
        "autoscaling.replica_scaling": "false",
    }
    return {**pinned, **dict(args or {})}


def ucx_args(tls: str) -> dict[str, str]:
    """Arguments that set ``UCX_TLS`` in both pools' replicas (e.g. ``tcp``: the KV goes over
    TCP sockets even on one machine, where UCX would otherwise use shared memory)."""
    return {f"{pool}.env_vars": f"{{UCX_TLS: {tls}}}" for pool in POOL_RESOURCES}


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _ready(f"{base_url}/ready"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"GET {base_url}/ready did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.1)


def deploy(args: Mapping[str, str], port: int = 8000, timeout_s: float = READY_TIMEOUT_S) -> str:
    """Run ``disagg_app`` with ``args`` on the connected cluster and return its URL once
    ``/ready`` answers. Called again (other args), it deletes the running application first
    rather than rolling it over: each worker holds one pool's replicas, so the new ones could
    not start before the old ones stop, and no request meets an old replica half-stopped.
    One HTTP proxy, on the head: per-node proxies would all want ``port`` on this machine."""
    from app.config import disagg_app

    application = disagg_app(dict(args))  # invalid args fail here, before anything is stopped
    serve.start(proxy_location="HeadOnly", http_options={"host": HOST, "port": port})
    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)
    serve.run(application, name=APP_NAME, route_prefix="/")
    base_url = f"http://{HOST}:{port}"
    _wait_ready(base_url, timeout_s)
    return base_url


def _sizes(args: Mapping[str, str]) -> tuple[int, int, float]:
    """Each worker offers as many slots as its pool has replicas (at least 1), and the
    logical CPUs they ask for (at least ``WORKER_CPUS``)."""
    config = AppConfig.load(dict(args))
    pools = (config.prefill, config.decode)
    slots = [max(1, pool.num_replicas) for pool in pools]
    cpus = max(WORKER_CPUS, *(n * pool.num_cpus for n, pool in zip(slots, pools)))
    return slots[0], slots[1], cpus


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # the same teardown as Ctrl-C


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.local_cluster", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start head + prefill node + decode node, serve disagg_app until Ctrl-C")
    up.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    up.add_argument("--ucx-tls", help="UCX_TLS for the engine replicas, e.g. tcp (default: UCX's own choice)")
    up.add_argument("args", nargs="*", metavar="key=value", help="disagg_app arguments, as for `serve run`")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    options = _parse(argv)
    extra = dict(arg.split("=", 1) for arg in options.args)
    args = pinned_args({**(ucx_args(options.ucx_tls) if options.ucx_tls else {}), **extra})
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    with local_cluster(*_sizes(args)) as nodes:
        url = deploy(args, port=options.port)
        print(f"disagg_app on {url} (OpenAI API under {url}/v1); nodes: {nodes.node_ids}", flush=True)
        print(f"Ray logs under {nodes.temp_dir}; Ctrl-C stops the cluster", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("stopping the cluster", flush=True)
        finally:
            serve.shutdown()


if __name__ == "__main__":
    main()
