"""Every runnable benchmark (a bench module with a ``__main__`` block) answers ``python -m
bench.X --help`` with its usage and exit status 0. One subprocess runs them all, so torch and
Ray are imported once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
)
HELP_ALL = """
import contextlib, io, json, runpy, sys
answers = {}
for module in sys.argv[1:]:
    out, sys.argv = io.StringIO(), [module, "--help"]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = exit.code or 0
    answers[module] = [code, out.getvalue()]
print(json.dumps(answers))
"""


def test_every_benchmark_answers_help() -> None:
    assert {"bench.serve", "bench.compare", "bench.gpu_kv", "bench.reliability"} <= set(MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    for module in MODULES:
        code, text = answers[module]
        assert code == 0 and text.startswith("usage: "), f"{module}: exit {code}, {text[:300]!r}"
        assert "--help" in text or "-h" in text
