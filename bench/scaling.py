"""Replica-count scaling under a stepped decode-heavy load: ``python -m bench.scaling``.

A closed loop (each of N clients sends its next request when the last one ended) of short
prompts (``PROMPT_TOKENS``) and long outputs (``OUTPUT_TOKENS``, ``ignore_eos``, temperature
0), N stepping through ``STEPS`` (2 -> 8 -> 16 -> 8 -> 2 by default); when N falls, the
clients above it finish their request and stop. Each step lasts long enough for the default
policy's delays (scale up after 10 s, down after 30 s, a pending replica given up after 60 s).

Two systems, one after another, each in its own fresh local Ray (``bench.compare.Server``),
both starting at 1 prefill + 1 decode replica with ``bench.compare``'s COMMON settings:

* ``scaling``  disagg_app, the default autoscaling policy: lending and replica counts;
* ``lending``  the same with ``autoscaling.replica_scaling=false``: lending alone, fixed 1 + 1.

While each runs, ``GET /admin/autoscaler`` (each pool's target, reporting and pending
replicas, every replica's load, the decisions) and Serve's replica states are polled every
``POLL_S``; after it, the Serve logs' lines about scaling are kept. Stages (``--stage``):
``run`` (both systems; the raw records to ``--raw``, not committed), ``report`` (render
``docs/benchmarks/scaling.{json,png}`` and the second section of ``elastic.md`` from
``--raw``); ``all`` does both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.compare import COMMON
from bench.elastic import load_tokenizer, timeline_sample
from bench.ray_local import Server
from bench.scaling_report import DOC, ScalingRun, Step, load_runs, save_run, write_report
from bench.serve import Target, run, send
from workloads import BenchRequest, PromptBuilder

PROMPT_TOKENS = 64
OUTPUT_TOKENS = 128
# 8 clients need 2 decode replicas at the default policy's 6 decoding per replica, 16 need 3
# (a fourth engine replica: no CPU left for it, so given up after pending_timeout_s); the
# steps outlast scale_up_delay_s + a replica's start (~30 s here), pending_timeout_s, and
# scale_down_delay_s + the drain
STEPS = (Step(2, 45.0), Step(8, 75.0), Step(16, 100.0), Step(8, 60.0), Step(2, 75.0))
SYSTEMS = {  # name -> disagg_app's arguments on top of bench.compare's COMMON
    "scaling": {"transport.mode": "pull", "autoscaling.enabled": "true", "autoscaling.replica_scaling": "true"},
    "lending": {"transport.mode": "pull", "autoscaling.enabled": "true", "autoscaling.replica_scaling": "false"},
}
POLL_S = 1.0
APP = "bench"  # bench.compare.Server's application name
ENGINE_DEPLOYMENTS = ("PrefillServer", "DecodeServer")
# Serve log lines worth keeping: the controller's decisions, Serve adding / removing / not
# placing replicas, a stopping replica's drain, errors
LOG_LINE = re.compile(
    r"autoscaler (scale_up|scale_down|give_up|lend|reclaim|drained)|Adding \d+ replica|Removing \d+ replica"
    r"|taken more than|initializing replica|stopped: |stopping: |ERROR|Traceback|[Rr]esources required"
)
MAX_LOG_LINES = 400


# ---- the load ------------------------------------------------------------------------------


def step_at(steps: tuple[Step, ...], t: float) -> int:
    """The index of the step running at ``t`` seconds since the start (the last one after it)."""
    end = 0.0
    for index, step in enumerate(steps):
        end += step.seconds
        if t < end:
            return index
    return len(steps) - 1


def next_active(steps: tuple[Step, ...], t: float, client: int) -> float:
    """When ``client`` (0-based) is next among a step's clients after ``t``; the load's end if never."""
    start = 0.0
    for step in steps:
        if start > t and client < step.concurrency:
            return start
        start += step.seconds
    return start


class Requests:
    """Client ``i``'s ``n``-th request: a code prompt of exactly ``PROMPT_TOKENS`` tokens, cut
    at an offset of its own, the same for every system. It opens with its own tag, so its
    first KV block, and so (hash-chained) every block, is its own: no prefix-cache hit, every
    prompt is prefilled whole and its KV moved, on any replica (the code corpus repeats one
    function, and the cache of a new replica starts cold, so hits would differ by system)."""

    def __init__(self, tokenizer) -> None:
        self.builder = PromptBuilder(tokenizer)

    def get(self, client: int, number: int) -> BenchRequest:
        offset = (7919 * client + 131 * number) % 10_000
        tag = self.builder.ids(f"# request {client}.{number}\n")
        prompt = tag + self.builder.code(PROMPT_TOKENS - len(tag), offset)
        return BenchRequest(prompt, PROMPT_TOKENS, OUTPUT_TOKENS)


async def closed_loop(target: Target, steps: tuple[Step, ...], requests: Requests, t0: float) -> list[dict]:
    """Every client's requests, sent back to back while the running step counts the client
    in; each row: ``client``, ``step`` (at its send), ``sent_s`` (since ``t0``), ``record``."""
    total_s = sum(s.seconds for s in steps)
    rows: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one_client(index: int) -> None:
            number = 0
            while (now := time.perf_counter() - t0) < total_s:
                step = step_at(steps, now)
                if index >= steps[step].concurrency:
                    await asyncio.sleep(max(0.0, next_active(steps, now, index) - now))
                    continue
                record = await send(client, target, requests.get(index, number))
                row = {"client": index, "number": number, "step": step, "sent_s": round(record.sent - t0, 4)}
                rows.append(row | {"record": record.to_json()})
                number += 1

        await asyncio.gather(*(one_client(i) for i in range(max(s.concurrency for s in steps))))
    return sorted(rows, key=lambda r: r["sent_s"])


# ---- what the autoscaler and Serve say meanwhile ---------------------------------------------


class CpuMeter:
    """Busy cores since the last reading: the whole machine's (/proc/stat) and this process
    tree's (the driver, Ray, the replicas: all started from here), so that the report shows
    how much CPU other processes took from the run."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.hz = os.sysconf("SC_CLK_TCK")
        self.last_machine = self._machine()
        self.last_ours = self._ours()
        self.last_time = time.monotonic()

    def _machine(self) -> int:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4]  # idle and iowait are not busy

    def _ours(self) -> dict[int, float]:
        seconds = {}
        for process in [self.me, *self.me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                seconds[process.pid] = times.user + times.system  # not children_*: a reaped child would count twice
            except self.psutil.Error:  # ended meanwhile
                continue
        return seconds

    def read(self) -> dict[str, float]:
        """``machine`` and ``ours``: busy cores (CPU seconds per second) since the last call."""
        machine, ours, now = self._machine(), self._ours(), time.monotonic()
        elapsed = max(now - self.last_time, 1e-3)
        used = sum(max(0.0, s - self.last_ours.get(pid, 0.0)) for pid, s in ours.items())
        reading = {
            "machine": round((machine - self.last_machine) / self.hz / elapsed, 2),
            "ours": round(used / elapsed, 2),
        }
        self.last_machine, self.last_ours, self.last_time = machine, ours, now
        return reading


def serve_states() -> dict[str, dict[str, int]]:
    """Serve's replica states (STARTING, RUNNING, STOPPING, ...) of the engine deployments."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return {}
    return {
        name: {str(getattr(state, "value", state)): count for state, count in dep.replica_states.items()}
        for name, dep in app.deployments.items()
        if name in ENGINE_DEPLOYMENTS
    }


async def poll(url: str, t0: float, wall0: float, stop: asyncio.Event, timeline: list, decisions: dict) -> None:
    """One sample per ``POLL_S``: the busy cores, the autoscaler's view (pools, replicas) and
    Serve's replica states; every decision seen is kept once (by its controller time, action
    and subject)."""
    meter = CpuMeter()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            tick = time.perf_counter()
            sample: dict = {"t": round(tick - t0, 2), "cpu": meter.read()}
            try:
                view = (await client.get(url + "/admin/autoscaler")).json()
                sample |= timeline_sample(view, tick - t0) | {"scaling": view.get("scaling", {})}
                for d in view.get("decisions", []):
                    key = (d["monotonic_s"], d["action"], d["replica"], d["role"])
                    decisions[key] = {"t": round(d["time"] - wall0, 2), **d}
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                print(f"autoscaler poll failed: {exc!r}", file=sys.stderr)
            try:
                sample["serve"] = await asyncio.to_thread(serve_states)
            except Exception as exc:  # Serve's controller busy: this sample goes without
                print(f"serve.status failed: {exc!r}", file=sys.stderr)
            timeline.append(sample)
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, POLL_S - (time.perf_counter() - tick)))
            except TimeoutError:
                pass


async def drive(target: Target, steps: tuple[Step, ...], requests: Requests) -> tuple[list, list, list, float, float]:
    """The stepped load with the poller beside it; the rows, the polls, the decisions (in
    order of time), the run's length (s) and its start (``time.time()``)."""
    timeline: list[dict] = []
    decisions: dict[tuple, dict] = {}
    stop = asyncio.Event()
    t0, wall0 = time.perf_counter(), time.time()
    poller = asyncio.create_task(poll(target.url, t0, wall0, stop, timeline, decisions))
    rows = await closed_loop(target, steps, requests, t0)
    duration = time.perf_counter() - t0
    await asyncio.sleep(2 * POLL_S)  # the last requests' end in the timeline
    stop.set()
    await poller
    return rows, timeline, sorted(decisions.values(), key=lambda d: d["t"]), duration, wall0


# ---- one system ------------------------------------------------------------------------------


def warm_up(target: Target, requests: Requests) -> None:
    """Two short requests through the path (not counted)."""
    probe = BenchRequest(requests.get(0, 10_000).prompt, PROMPT_TOKENS, 4)
    records, _ = asyncio.run(run(target, [probe, probe], [0.0, 0.0], progress=False))
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0]}")


def logs_dir() -> Path | None:
    """This Ray session's log folder (a private Ray call: None where it moved)."""
    try:
        from ray._private import worker

        return Path(worker._global_node.get_logs_dir_path())
    except (AttributeError, ImportError):
        return None


def log_lines(paths: list[Path]) -> list[str]:
    """The log lines about scaling (``LOG_LINE``), ``file: line``, in file order."""
    lines = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if LOG_LINE.search(line):
                lines.append(f"{path.name}: {line.strip()}")
    return lines[:MAX_LOG_LINES]


def run_system(system: str, index: int, options: Options, requests: Requests, command: str) -> ScalingRun:
    """Start ``system``, warm it up, drive the steps; the Serve logs are copied to the raw folder."""
    started = time.time()
    with Server("disagg", {**COMMON, **SYSTEMS[system]}, index) as server:
        target = Target(server.url, server.model())
        warm_up(target, requests)
        logs = logs_dir()
        rows, timeline, decisions, duration, wall0 = asyncio.run(drive(target, options.steps, requests))
    kept: list[str] = []
    if logs is not None and (logs / "serve").is_dir():
        copy = options.raw / f"serve_logs_{system}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(logs / "serve", copy)
        # a stopping replica's own lines (``__del__``) reach its worker's stderr, not its Serve log
        kept = log_lines(sorted(copy.glob("*.log")) + sorted(logs.glob("worker-*.err")))
    return ScalingRun(
        system=system,
        command=command,
        args={**COMMON, **SYSTEMS[system]},
        steps=options.steps,
        elapsed_s=time.time() - started,
        duration_s=duration,
        wall0=wall0,
        rows=rows,
        timeline=timeline,
        decisions=decisions,
        log_lines=kept,
    )


# ---- the command line ------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The command line, checked."""

    steps: tuple[Step, ...]
    systems: tuple[str, ...]
    stage: str
    out: Path
    raw: Path


def parse_steps(text: str) -> tuple[Step, ...]:
    """``2:60,8:75`` -> two steps (clients, seconds)."""
    steps = []
    for item in text.split(","):
        clients, _, seconds = item.partition(":")
        try:
            step = Step(int(clients), float(seconds))
        except ValueError:
            sys.exit(f"--steps: {item!r} is not CLIENTS:SECONDS")
        if step.concurrency < 1 or step.seconds <= 0:
            sys.exit(f"--steps: {item!r}: at least 1 client for more than 0 s")
        steps.append(step)
    return tuple(steps)


def parse_options(argv: list[str] | None = None) -> Options:
    default_steps = ",".join(f"{s.concurrency}:{s.seconds:g}" for s in STEPS)
    parser = argparse.ArgumentParser(prog="bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=default_steps, help="CLIENTS:SECONDS,... closed-loop steps")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="in the order run: " + ", ".join(SYSTEMS))
    parser.add_argument("--stage", choices=("all", "run", "report"), default="all")
    parser.add_argument("--out", default=str(DOC), help="folder for scaling.json/png and elastic.md")
    parser.add_argument("--raw", default="/tmp/scaling_raw", help="folder for the raw records (not committed)")
    args = parser.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    for name in systems:
        if name not in SYSTEMS:
            sys.exit(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    return Options(parse_steps(args.steps), systems, args.stage, Path(args.out), Path(args.raw))


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    command = "python -m bench.scaling" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    options.raw.mkdir(parents=True, exist_ok=True)
    if options.stage in ("all", "run"):
        requests = Requests(load_tokenizer())
        for index, system in enumerate(options.systems):
            result = run_system(system, index, options, requests, command)
            save_run(options.raw, result)
            lost = sum(1 for row in result.rows if not _complete(row["record"]))
            print(
                f"{system}: {len(result.rows)} requests, {lost} lost, {len(result.decisions)} decisions",
                file=sys.stderr,
            )
    write_report(load_runs(options.raw), options.out)


def _complete(record: dict) -> bool:
    return record["error"] is None and (record["usage_output_tokens"] or 0) >= record["max_tokens"]


if __name__ == "__main__":
    main()
