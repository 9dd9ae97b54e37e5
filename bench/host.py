"""This machine and its processes, as the benchmarks measure and describe them: the machine
line of every report, CPU ticks from ``/proc``, an engine in this process, a measurement in
a fresh subprocess."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def machine() -> str:
    """Cores, memory, Python, torch and GPU of this machine, for the report."""
    import psutil
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, torch {torch.__version__}, {gpu}"
    )


def cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def cpu_ticks() -> tuple[int, int, int]:
    """(busy, total, steal) CPU ticks of the whole machine so far (``/proc/stat``; idle and
    iowait are not busy)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks), ticks[7]


def tree_ticks(root: int | None = None) -> dict[int, int]:
    """utime + stime ticks of ``root`` (this process) and each of its live descendants, by pid:
    the driver, the Ray cluster and the replicas it started."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])
    found, todo = {}, [root or os.getpid()]
    while todo:
        pid = todo.pop()
        found[pid] = ticks.get(pid, 0)
        todo += children.get(pid, [])
    return found


def ticks_between(before: dict[int, int], after: dict[int, int]) -> int:
    """Ticks the processes used between two ``tree_ticks`` readings (one that ended meanwhile
    counts nothing, never less than nothing)."""
    return sum(max(0, ticks - before.get(pid, 0)) for pid, ticks in after.items())


def engine_core(threads: int = 1, **config):
    """An ``EngineCore`` of the default model in this process, ``threads`` torch threads (a
    replica runs one)."""
    import torch

    torch.set_num_threads(threads)
    from engine.config import EngineConfig
    from engine.core import EngineCore

    return EngineCore.from_spec(config=EngineConfig(**config))


def tokenizer(source: str = "default"):
    from engine.loader import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec(source=source))


def worker_json(module: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """``python -m module args`` in a fresh process (its own torch threads, memory and caches);
    the JSON of its last stdout line. Exits with its stderr when it fails."""
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])
