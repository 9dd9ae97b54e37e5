"""Run Serve applications for a test module: one way to start them, wait for them, and tear down.

``local_serve`` starts a local Ray (own temp dir, see ``bench.ray_local``) and runs the
applications on it; ``run_apps`` runs them on a Ray the caller already started (the pinning
test's multi-node ``cluster_utils`` cluster). Either one shuts Serve (and Ray, when it
started it) down on the way out, also when starting failed half-way, so a module that could
not start its applications does not leave a Ray behind for the next module's ``ray.init``.

Used from module-scoped fixtures, so the applications start once per module::

    @pytest.fixture(scope="module")
    def served():
        with local_serve([ServeApp("busy", colocated_app, {...})], port=PORT) as served:
            yield served
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from bench.ray_local import start_local_ray
from tests.waiting import wait_until

HOST = "127.0.0.1"
SMALL_COLOCATED = {  # one small colocated replica: for tests of the ingress's own checks
    "model.max_model_len": "512",
    "engine.kv_cache_bytes": str(32 << 20),
    "colocated.num_replicas": "1",
}
READY_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ServeApp:
    """One application: ``builder(args)`` (e.g. ``app.config.disagg_app``) served at ``route_prefix``."""

    name: str
    builder: Callable[[dict[str, str]], serve.Application]
    args: dict[str, str] = field(default_factory=dict)
    route_prefix: str = "/"

    @property
    def url_prefix(self) -> str:
        """The prefix to put after the base URL: ``""`` for the root application."""
        return self.route_prefix.rstrip("/")


@dataclass(frozen=True)
class ServedApps:
    """What the tests get: the HTTP base URL (no trailing slash) and deployment handles."""

    base_url: str

    def handle(self, deployment: str, app: str) -> DeploymentHandle:
        return serve.get_deployment_handle(deployment, app_name=app)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_http_ready(base_url: str, apps: Sequence[ServeApp], timeout_s: float = READY_TIMEOUT_S) -> None:
    """``serve.run`` returns once the replicas run; the HTTP proxy may route a moment later."""
    for app in apps:
        url = f"{base_url}{app.url_prefix}/ready"
        wait_until(lambda url=url: _ready(url), timeout_s, f"GET {url} to answer 200", poll_s=0.1)


@contextmanager
def run_apps(apps: Sequence[ServeApp], port: int) -> Iterator[ServedApps]:
    """Start Serve's HTTP proxy on ``port``, run ``apps`` and wait until each answers over
    HTTP; ``serve.shutdown()`` on exit. Ray must be running."""
    try:
        serve.start(http_options={"host": HOST, "port": port})
        for app in apps:  # each call returns once the application's replicas are running
            serve.run(app.builder(dict(app.args)), name=app.name, route_prefix=app.route_prefix)
        base_url = f"http://{HOST}:{port}"
        wait_http_ready(base_url, apps)
        yield ServedApps(base_url)
    finally:
        serve.shutdown()


@contextmanager
def local_serve(apps: Sequence[ServeApp], port: int) -> Iterator[ServedApps]:
    """``run_apps`` on a local Ray started here (2 CPUs, own temp dir); ``ray.shutdown()`` on exit."""
    start_local_ray()
    try:
        with run_apps(apps, port) as served:
            yield served
    finally:
        ray.shutdown()
