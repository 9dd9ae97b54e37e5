"""The engine package bounds PyTorch's per-shape CPU kernel caches (``engine/__init__.py``),
leaving an operator's own setting alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
PROBE = f"import json, os, engine; print(json.dumps({{k: os.environ.get(k) for k in {CACHES!r}}}))"


def _seen(extra_env: dict[str, str]) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in CACHES}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**env, **extra_env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_engine_bounds_both_caches() -> None:
    assert _seen({}) == {name: "64" for name in CACHES}


def test_an_operators_setting_wins() -> None:
    assert _seen({"LRU_CACHE_CAPACITY": "8"}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "8"}
