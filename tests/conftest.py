"""Shared fixtures: models are loaded once per session (see tests/engine for the engine ones)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.loader import LoadedModel, ModelSpec, load_model

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
