"""The small colocated app with API keys on, shared by test_auth and test_fuzz: one
deployment kept between the two modules (tests/serving.py), so its settings are theirs
together: the tiny served model (tests/tiny_models.py: what is tested here is the HTTP
layer, not the model), a key file and inline keys, and a small ``limits.max_tokens`` that
keeps each fuzzed request short (auth's requests ask for fewer tokens than that). The last
of its users (in the order pytest runs them) deletes it: an idle replica still costs CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import SMALL_COLOCATED, ServeApp, SharedServe
from tests.tiny_models import TinyServed

FILE_KEY = "sk-tandem-file-7f3c9a1e5b2d"
INLINE_KEY = "sk-tandem-inline-2d8e4b6f0a"
FUZZ_KEY = "sk-tandem-fuzz-5e6f7a8b"
MAX_TOKENS = 4
APP = "keyed"
USERS = ("tests.deployments.test_auth", "tests.deployments.test_fuzz")


@pytest.fixture(scope="session")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "api_keys"
    path.write_text(f"# the auth test's keys\n\n{FILE_KEY}\n")
    return path


@pytest.fixture(scope="module")
def keyed_url(
    request: pytest.FixtureRequest, shared_serve: SharedServe, tiny_served: TinyServed, key_file: Path
) -> Iterator[str]:
    from app.config import colocated_app

    args = {
        **SMALL_COLOCATED,
        **tiny_served.args,
        "auth.api_keys_file": str(key_file),
        "auth.api_keys": f"[{INLINE_KEY}, {FUZZ_KEY}]",
        "limits.max_tokens": str(MAX_TOKENS),
    }
    keep = request.module.__name__ != USERS[-1]
    with shared_serve.apps([ServeApp(APP, colocated_app, args)], keep=keep) as served:
        yield served.url(APP)
