"""Shared fixtures: models are loaded once per session (see tests/engine for the engine ones)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from engine.loader import LoadedModel, ModelSpec, load_model
from tests.serving import SharedServe

torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """The default model (SmolLM2-135M-Instruct, float32) for engines under test."""
    return load_model(ModelSpec())


@pytest.fixture(scope="session")
def smol_reference() -> LoadedModel:
    """A second, untouched copy with transformers' own attention, for ``generate`` references."""
    loaded = load_model(ModelSpec())
    loaded.model.generation_config.eos_token_id = None  # compare a fixed number of tokens
    return loaded


@pytest.fixture(scope="session")
def shared_serve() -> Iterator[SharedServe]:
    """The session's one Ray and Serve (tests/serving.py), started at first use."""
    shared = SharedServe()
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def own_cluster(shared_serve: SharedServe) -> None:
    """For a module that starts a Ray cluster of its own: the shared one is stopped first."""
    shared_serve.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a cluster of their own run first, so the shared Ray starts only once; a
    module that names another in ``SHARES_APPS_WITH`` (tests/serving.py) runs just before it."""
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.module.__name__, index)

    def order(item: pytest.Item) -> tuple[bool, int, bool]:
        anchor = getattr(item.module, "SHARES_APPS_WITH", None)
        return "own_cluster" not in item.fixturenames, first.get(anchor or item.module.__name__, 0), anchor is None

    items.sort(key=order)
