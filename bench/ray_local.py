"""Start a local Ray cluster for tests and benchmarks: own temp dir, the repo importable."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]


def repo_on_pythonpath() -> None:
    """Workers inherit the driver's environment: let them import this checkout's packages."""
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def start_local_ray(num_cpus: int = 2, object_store_memory: int | None = None, **kwargs) -> None:
    """``kwargs`` go to ``ray.init`` (e.g. ``_metrics_export_port``)."""
    repo_on_pythonpath()
    if object_store_memory:
        kwargs["object_store_memory"] = object_store_memory
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        log_to_driver=False,
        **kwargs,
    )
