"""Run Serve applications for the tests: one Ray and one Serve for the whole test session.

Starting Ray, Serve and an engine replica is most of what a served test costs on a small
machine, so the session starts Ray and Serve once (``SharedServe``, the ``shared_serve``
fixture in tests/conftest.py) and each module runs its applications on it, each at its own
route prefix::

    @pytest.fixture(scope="module")
    def url(shared_serve):
        with shared_serve.apps([ServeApp("busy", colocated_app, {...})]) as served:
            yield served.url("busy")

An application is deleted when its module is done, unless the module keeps it for the next
one (``keep=True``: the same name with the same arguments is then reused as it runs). The
number of engine replicas alive at once is bounded (``MAX_ENGINE_REPLICAS``): kept
applications that no module is using are deleted first. An application that a test left
unhealthy (not RUNNING, or ``/ready`` not answering) is deployed again, and a Ray that died
is started again, so a failure in one module does not fail the next.

A module that runs on another module's kept application names it in ``SHARES_APPS_WITH``:
tests/conftest.py runs it just before that module, so nothing runs between them that would
need the room.

Modules that only start actors of their own on Ray ask for the ``shared_ray`` fixture (Ray,
no application). Modules that need a cluster of their own (several nodes: ``run_apps`` on
``cluster_utils``) ask for the ``own_cluster`` fixture, which stops the shared Ray first.
tests/conftest.py orders the modules (and splits them between pytest-xdist's workers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import ray
from ray import serve
from ray.serve.api import RunTarget
from ray.serve.handle import DeploymentHandle

from app.local_cluster import start_local_ray, stop_local_ray
from tests.waiting import wait_until

HOST = "127.0.0.1"
SHARED_PORT = 18400 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])  # two workers, two ports
SHARED_NUM_CPUS = 4  # Ray's logical CPUs: room for a module's replicas beside the kept ones
SMALL_COLOCATED = {  # one small colocated replica: for tests of the ingress's own checks
    "model.max_model_len": "512",
    "engine.kv_cache_bytes": str(32 << 20),
    "colocated.num_replicas": "1",
}
SERVED_CONTEXT = 1024
SERVED_COMMON = {  # tests/deployments/test_serve_app.py's applications, fixed pools
    "model.max_model_len": str(SERVED_CONTEXT),
    "engine.kv_cache_bytes": str(64 << 20),
    "prefill.num_cpus": "0.25",
    "decode.num_cpus": "0.25",
    "colocated.num_cpus": "0.25",
    "colocated.num_replicas": "1",
    "autoscaling.enabled": "false",
}
SPECULATIVE = {"speculative.method": "ngram", "speculative.num_speculative_tokens": "4"}
READY_TIMEOUT_S = 240.0
DELETE_TIMEOUT_S = 300.0  # past any replica's graceful-stop bound (up to 120 s: the policy's)
ENGINE_DEPLOYMENTS = frozenset({"PrefillServer", "DecodeServer", "ColocatedServer"})
MAX_ENGINE_REPLICAS = 6  # an engine replica peaks near 2.5 GB; the machine has 24 GiB
MODULE_ENGINE_REPLICAS = 5  # the most one module runs at once (three apps: 2 + 2 + 1)


@dataclass(frozen=True)
class ServeApp:
    """One application: ``builder(args)`` (e.g. ``app.config.disagg_app``) served at
    ``route_prefix`` (by default ``/<name>``)."""

    name: str
    builder: Callable[[dict[str, str]], serve.Application]
    args: dict[str, str] = field(default_factory=dict)
    route_prefix: str | None = None

    @property
    def prefix(self) -> str:
        return self.route_prefix or f"/{self.name}"

    @property
    def url_prefix(self) -> str:
        """The prefix to put after the base URL: ``""`` for the root application."""
        return self.prefix.rstrip("/")


@dataclass(frozen=True)
class ServedApps:
    """What the tests get: the HTTP base URL (no trailing slash), each application's URL and
    deployment handles."""

    base_url: str
    apps: tuple[ServeApp, ...] = ()

    def url(self, app: str) -> str:
        (served,) = [a for a in self.apps if a.name == app]
        return self.base_url + served.url_prefix

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


def _deploy(apps: Sequence[ServeApp]) -> None:
    """All of ``apps`` at once (their replicas start side by side); returns once they run."""
    if apps:
        serve.run_many([RunTarget(a.builder(dict(a.args)), name=a.name, route_prefix=a.prefix) for a in apps])


@contextmanager
def run_apps(apps: Sequence[ServeApp], port: int) -> Iterator[ServedApps]:
    """Start Serve's HTTP proxy on ``port``, run ``apps`` and wait until each answers over
    HTTP; ``serve.shutdown()`` on exit. Ray must be running (a cluster of the caller's)."""
    try:
        serve.start(http_options={"host": HOST, "port": port})
        _deploy(apps)
        base_url = f"http://{HOST}:{port}"
        wait_http_ready(base_url, apps)
        yield ServedApps(base_url, tuple(apps))
    finally:
        serve.shutdown()


def served_disagg() -> ServeApp:
    """test_serve_app's pull application (``disagg_app`` with speculation, at /serve), which
    tests/bench/test_serve_bench.py runs on just before it (``SHARES_APPS_WITH``) and keeps."""
    from app.config import disagg_app

    return ServeApp("disagg", disagg_app, {**SERVED_COMMON, **SPECULATIVE}, route_prefix="/serve")


class SharedServe:
    """The test session's Ray and Serve, and the applications running on them (see the
    module's docstring)."""

    def __init__(self, port: int = SHARED_PORT) -> None:
        self.base_url = f"http://{HOST}:{port}"
        self._port = port
        self._running: dict[str, ServeApp] = {}  # deployed here, in order of last use
        self._kept: set[str] = set()

    @contextmanager
    def apps(self, apps: Sequence[ServeApp], keep: bool = False) -> Iterator[ServedApps]:
        """Run ``apps`` (reusing those already running as asked and healthy); delete them on
        the way out unless ``keep``."""
        self._start()
        wanted = {a.name for a in apps}
        stale = [a for a in apps if self._running.get(a.name) != a or not self._healthy(a)]
        self._delete(*(app.name for app in stale))
        self._make_room(wanted)
        try:
            _deploy(stale)
        except Exception:
            self._delete(*(app.name for app in stale))
            raise
        for app in apps:
            self._running.pop(app.name, None)
            self._running[app.name] = app
        self._kept = (self._kept | wanted) if keep else (self._kept - wanted)
        try:
            wait_http_ready(self.base_url, apps)
            yield ServedApps(self.base_url, tuple(apps))
        finally:
            if not keep:
                self._delete(*(app.name for app in apps))

    def ray(self) -> None:
        """Ray running (for tests that start actors of their own on it)."""
        self._start()

    def stop(self) -> None:
        """Serve and Ray down (a module that starts its own cluster asks for this first)."""
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:  # TANDEM_KEEP_CLUSTER_LOGS=1 keeps Ray's temp dir (its logs)
                stop_local_ray(keep_logs=bool(os.environ.get("TANDEM_KEEP_CLUSTER_LOGS")))
        self._running.clear()
        self._kept.clear()

    def _start(self) -> None:
        if ray.is_initialized() and not self._alive():
            self.stop()  # a Ray that died under a test: start a new one
        if not ray.is_initialized():
            self._running.clear()
            start_local_ray(num_cpus=SHARED_NUM_CPUS)
            serve.start(http_options={"host": HOST, "port": self._port})

    @staticmethod
    def _alive() -> bool:
        try:
            serve.status()
        except Exception:  # the controller or Ray itself is gone: anything may be broken
            return False
        return True

    def _healthy(self, app: ServeApp) -> bool:
        status = serve.status().applications.get(app.name)
        return status is not None and status.status == "RUNNING" and _ready(f"{self.base_url}{app.url_prefix}/ready")

    def _delete(self, *names: str) -> None:
        """Delete these applications, side by side (each stop takes a while), and wait until
        they are gone."""
        for name in names:
            self._running.pop(name, None)
            self._kept.discard(name)
        deployed = [name for name in names if name in serve.status().applications]
        for name in deployed:
            serve.delete(name, _blocking=False)
        wait_until(
            lambda: not set(deployed) & set(serve.status().applications),
            DELETE_TIMEOUT_S,
            f"applications {deployed} deleted",
            poll_s=0.1,
        )

    def _engine_replicas(self, names: set[str]) -> int:
        applications = serve.status().applications
        return sum(
            sum(deployment.replica_states.values())
            for name in names
            if name in applications
            for deployment_name, deployment in applications[name].deployments.items()
            if deployment_name in ENGINE_DEPLOYMENTS
        )

    def _make_room(self, wanted: set[str]) -> None:
        """Delete kept applications no module is using (least recently used first) until the
        next module's replicas fit within ``MAX_ENGINE_REPLICAS``."""
        budget = MAX_ENGINE_REPLICAS - MODULE_ENGINE_REPLICAS
        for name in [n for n in self._running if n not in wanted]:
            if self._engine_replicas(set(self._running) - wanted) <= budget:
                return
            self._delete(name)
