"""A local Ray cluster for tests and benchmarks (own temp dir, the repo importable), and a Serve
application in one of its own."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import ray
from ray import serve

ROOT = Path(__file__).resolve().parents[1]
HTTP_PORT = 18480
METRICS_PORT = 18490  # + the server's index: a fresh cluster's metrics never mix with the last one's


_TEMP_DIRS: list[str] = []  # of the clusters this process started: stop_local_ray removes them


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
        self.url, self.metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{METRICS_PORT + index}/metrics"

    def __enter__(self) -> Server:
        from app.config import colocated_app, disagg_app

        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C and SIGTERM end the run
        signal.signal(signal.SIGTERM, _exit_on_signal)  # ... and stop this cluster in __exit__
        start_local_ray(_metrics_export_port=METRICS_PORT + self.index,
                        _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
        self.log_dir = _logs_dir()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
            builder = colocated_app if self.application == "colocated" else disagg_app
            serve.run(builder(dict(self.args)), name=self.name, route_prefix="/")
            self._wait_ready(240.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() <= deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.url}/ready did not answer 200 within {timeout_s:.0f} s")

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
    try:
        from ray._private import worker

        return Path(worker._global_node.get_logs_dir_path())
    except (AttributeError, ImportError):
        return None
