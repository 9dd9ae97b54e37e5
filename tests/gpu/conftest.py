"""CUDA tests: each needs the ``cuda`` fixture (or the ``cuda`` marker) and is skipped where
``torch.cuda.is_available()`` is False.

``TANDEM_GPU_TESTS_ON_CPU=1`` makes the ``cuda`` fixture return the CPU device instead: a
dry run, where there is no GPU, of the tests written against that fixture alone (tests with
the marker still skip).

Not the ``gpu`` marker: ``pyproject.toml``'s ``addopts`` deselects that one, so a plain
``pytest tests/gpu`` on a GPU machine would run nothing. This file imports only pytest and
torch (the GPU machine has no Ray, Serve or openai; pydantic comes from carried wheels).
"""

from __future__ import annotations

import os

import pytest
import torch

NO_CUDA = "needs CUDA (torch.cuda.is_available() is False)"
ON_CPU = os.environ.get("TANDEM_GPU_TESTS_ON_CPU") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped where none is available")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    """The CUDA device; skips the test where there is none (the CPU with ``TANDEM_GPU_TESTS_ON_CPU=1``)."""
    if ON_CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.device("cuda")
