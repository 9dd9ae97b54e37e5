"""This machine and its processes as the benchmarks see them: the report's machine line, CPU
ticks from ``/proc``, timings that drift alike, an engine in this process, a fresh subprocess."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def machine() -> str:
    import psutil
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    memory = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    return f"{os.cpu_count()} cores, {memory}, Python {platform.python_version()}, torch {torch.__version__}, {gpu}"


def cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def cpu_ticks() -> tuple[int, int, int]:
    """(busy, total, steal) CPU ticks of the machine so far (``/proc/stat``; idle and iowait are not busy)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks), ticks[7]


def tree_ticks(root: int | None = None) -> dict[int, int]:
    """utime + stime ticks of ``root`` (this process) and each live descendant, by pid."""
    children, ticks = dict[int, list[int]](), dict[int, int]()
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
    """Ticks used between two ``tree_ticks`` readings (a process that ended counts nothing)."""
    return sum(max(0, ticks - before.get(pid, 0)) for pid, ticks in after.items())


def seconds(fn: Callable[[], object]) -> float:
    return timed(fn)[1]


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()``'s result and the seconds it took."""
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def medians(kinds: Sequence, repeats: int, once: Callable[[object, int], float]) -> dict:
    """Median of ``once(kind, rep)`` per kind over ``repeats`` after a warm-up; each repetition
    starts with the next kind, so a slow spell of the machine hits every kind alike."""
    kinds = list(kinds)
    times: dict = {kind: [] for kind in kinds}
    for rep in range(repeats + 1):
        for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
            times[kind].append(once(kind, rep))
    return {kind: statistics.median(t[1:]) for kind, t in times.items()}


def synchronize(device) -> None:
    """Wait for the device's kernels (a CUDA device; UCX copies on its own streams, blind to torch's)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def engine_core(threads: int = 1, **config):
    """An ``EngineCore`` of the default model in this process, ``threads`` torch threads (a replica runs one)."""
    import torch

    torch.set_num_threads(threads)
    from engine.config import EngineConfig
    from engine.core import EngineCore

    return EngineCore.from_spec(config=EngineConfig(**config))


def tokenizer(source: str = "default"):
    from engine.loader import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec(source=source))


def worker_json(module: str, function: str, *args: object, env: dict[str, str] | None = None):
    """``module.function(*args)`` (JSON in and out) in a fresh process: its own threads, memory and caches;
    exits with its stderr when it fails."""
    code = f"import json, sys\nfrom {module} import {function} as f\nprint(json.dumps(f(*json.loads(sys.argv[1]))))"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])
