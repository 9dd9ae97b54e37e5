"""Shared fixtures: models are loaded once per session (see tests/engine for the engine ones)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

# Serve's controller reconciles every 0.1 s by default: 4 CPU-seconds a minute of an idle app's
# 13 on two shared cores. Every test waits on conditions, none on Serve's pace, so the clusters
# the tests start (they inherit this environment) reconcile every 0.5 s: 1 CPU-second a minute.
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")

if TYPE_CHECKING:  # imported where a test runs: pytest-xdist's controller never needs torch or Ray
    from engine.loader import LoadedModel
    from tests.serving import SharedServe
    from tests.tiny_models import TinyServed


@pytest.fixture(scope="session", autouse=True)
def torch_threads() -> None:
    """One torch thread beside pytest-xdist's other worker (its Ray replicas take the other core:
    two threads each would oversubscribe the two cores and slow replica starts several times)."""
    import torch

    threads = os.environ.get("TANDEM_TEST_THREADS", "1" if "PYTEST_XDIST_WORKER" in os.environ else "2")
    torch.set_num_threads(int(threads))


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """The default model (SmolLM2-135M-Instruct, float32) for engines under test."""
    from engine.loader import ModelSpec, load_model

    return load_model(ModelSpec())


@pytest.fixture(scope="session")
def smol_reference() -> LoadedModel:
    """A second, untouched copy with transformers' own attention, for ``generate`` references."""
    from engine.loader import ModelSpec, load_model

    loaded = load_model(ModelSpec())
    loaded.model.generation_config.eos_token_id = None  # compare a fixed number of tokens
    return loaded


@pytest.fixture(scope="session")
def tiny_served(smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> TinyServed:
    from engine.loader import ModelSpec, load_model
    from tests.tiny_models import TinyServed, save_tiny_served

    folder = tmp_path_factory.mktemp("tiny-served")
    args = save_tiny_served(folder, smol)
    return TinyServed(args, load_model(ModelSpec(source=args["model.source"])))


SHARED = pytest.StashKey["SharedServe"]()


@pytest.fixture(scope="session")
def shared_serve(request: pytest.FixtureRequest) -> Iterator[SharedServe]:
    """The session's one Ray and Serve (tests/serving.py), started at first use and stopped
    once no test after it needs them (``pytest_runtest_teardown``)."""
    from tests.serving import SharedServe

    shared = request.config.stash[SHARED] = SharedServe()
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def shared_ray(shared_serve: SharedServe) -> None:
    """For a module that starts actors of its own on Ray (no Serve application)."""
    shared_serve.ray()


@pytest.fixture(scope="module")
def own_cluster(shared_serve: SharedServe) -> None:
    """For a module that starts a Ray cluster of its own: the shared one is stopped first."""
    shared_serve.stop()


ON_RAY = pytest.StashKey[set[str]]()
SERVED, IN_PROCESS, SERVED_BESIDE, ACTORS, OWN_CLUSTER = range(5)  # the kinds of module, in the order they run
ON_RAY_RANK = (IN_PROCESS, SERVED, ACTORS, OWN_CLUSTER)  # least to most of Ray
# served modules that run with the in-process ones (in the other pytest-xdist worker), after
# them: small apps of the tiny model (the keyed app's two users among them), moved there so that
# both workers end near the same time
SERVED_BESIDE_MODULES = frozenset(
    {"tests.deployments.test_tensor_parallel_app", "tests.deployments.test_auth", "tests.deployments.test_fuzz"}
)
DEFAULT_MODEL_FIXTURES = frozenset({"smol", "smol_reference", "tiny_served"})  # tiny_served copies its tokenizer


def _kind(item: pytest.Item) -> int:
    names = item.fixturenames
    if "own_cluster" in names:
        return OWN_CLUSTER
    if "shared_ray" in names:
        return ACTORS
    return SERVED if "shared_serve" in names else IN_PROCESS


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with Serve applications on the shared Ray run first, so it starts once; then the
    modules without Ray (the shared Ray stops before them: its idle processes would take CPU
    from them), those that need no default model first; then a few small served modules
    (``SERVED_BESIDE_MODULES``), the modules with actors on Ray, and those with a cluster of
    their own. A module that names another in ``SHARES_APPS_WITH`` (tests/serving.py) runs
    just before it.

    Under pytest-xdist's ``--dist loadgroup`` (``make test``: ``-n 2``) the modules with Serve
    applications are one group and the rest another: one worker runs the served tests (one
    Serve at a time, its replicas' memory bounded), mostly waiting on replicas, which leaves a
    core to the other worker's in-process tests; that worker then runs the rest on Ray beside
    the served tests' tail."""
    first: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.module.__name__, index)
        module = item.module.__name__  # a module's kind: that of its test on the most of Ray
        kinds[module] = max(kinds.get(module, IN_PROCESS), _kind(item), key=ON_RAY_RANK.index)
    kinds.update(dict.fromkeys(SERVED_BESIDE_MODULES & kinds.keys(), SERVED_BESIDE))
    config.stash[ON_RAY] = {module for module, kind in kinds.items() if kind != IN_PROCESS}

    # in-process modules that need no default model run first: a fresh machine converts it once
    # (minutes of CPU on a slow one) while they run, not while the worker waits for it
    on_model = {item.module.__name__ for item in items if DEFAULT_MODEL_FIXTURES & set(item.fixturenames)}

    def order(item: pytest.Item) -> tuple[int, bool, int, bool]:
        anchor = getattr(item.module, "SHARES_APPS_WITH", None)
        module = anchor or item.module.__name__
        kind = kinds.get(module, kinds[item.module.__name__])
        return kind, kind == IN_PROCESS and module in on_model, first.get(module, 0), anchor is None

    items.sort(key=order)
    if getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers
        for item in items:
            item.add_marker(pytest.mark.xdist_group("served" if kinds[item.module.__name__] == SERVED else "rest"))


def pytest_configure(config: pytest.Config) -> None:
    """Without the groups both workers would run served modules, each on a Ray of its own, with
    twice the engine replicas that ``MAX_ENGINE_REPLICAS`` allows: refuse the pytest on which
    pytest-xdist 3.8 drops the groups (pytest-dev/pytest-xdist#1386)."""
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple >= (9, 2):
        raise pytest.UsageError("--dist loadgroup needs pytest < 9.2 (pyproject.toml's [dev] extra pins it)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The shared Ray and Serve stop once the last module on them is done (its fixtures torn
    down: they delete its applications)."""
    yield
    shared = item.config.stash.get(SHARED, None)
    if shared is not None and nextitem is not None and nextitem.module.__name__ not in item.config.stash[ON_RAY]:
        shared.stop()
