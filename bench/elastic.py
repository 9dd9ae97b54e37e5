"""Elastic prefill/decode on a phase-changing trace: ``python -m bench.elastic``.

One trace, three phases of equal length (``PHASES``): prompt-heavy (long prompts, short
outputs), a decode-heavy burst (short prompts, long outputs, at a higher rate), prompt-heavy
again. Three systems, one after another, each in its own fresh local Ray
(``bench.compare.Server``), 2 engine replicas with 1 torch thread each:

* ``static``     disagg_app, pull, no autoscaler: 1 prefill + 1 decode replica;
* ``colocated``  colocated_app, 2 replicas doing both phases;
* ``elastic``    disagg_app, pull, the default autoscaling policy with the benchmark's SLOs,
  recording its snapshots (``autoscaling.record``) to the raw folder.

SLOs (``bench.compare``'s rule) come from the idle colocated system at the start: TTFT 5x
the uncontended TTFT of each class's median prompt (prompt-heavy and burst requests have
their own), TPOT 2x the uncontended TPOT. While the elastic system runs,
``GET /admin/autoscaler`` is polled every second for the timeline.

Stages (``--stage``): ``floor`` (the interference floor: a decode step with the other core
idle and while another process prefills, and the client's TPOT through the static app idle
and beside 8 streams), ``run`` (calibrate, then each system), ``report`` (render from the
raw records); ``all`` runs them in that order. Writes ``docs/benchmarks/elastic.{md,json,png}``;
the per-request records go to ``--raw`` (not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.compare import COMMON, MAX_MODEL_LEN
from bench.compare import SYSTEMS as COMPARE_SYSTEMS
from bench.elastic_report import (
    Calibration,
    ClassCalibration,
    Floor,
    Phase,
    SystemRun,
    load_calibration,
    load_raw,
    save_calibration,
    save_json,
    save_trace,
    write_report,
)
from bench.ray_local import Server
from bench.serve import Target, arrival_times, run, send, uncontended
from workloads import BenchRequest, PromptBuilder, median_request

# name, request class (its TTFT SLO), prompt tokens, output tokens (inclusive ranges), req/s.
# The rates are fixed for this 2-core machine (short trial runs): at 0.45 req/s of ~410-token
# prompts the static 1+1 system keeps its SLOs and the prefill replica is about half busy. The
# burst asks ~4.5x the prompt phases' output tokens per second (0.35 x 190 against 0.45 x 32):
# more than one decode replica serves within the TPOT SLO, so its batch grows through the burst.
# At 1.0 req/s (and already at 0.4) every system, colocated included, fell below 35% in the burst.
PHASES = (
    ("prompt-heavy 1", "prompt", (380, 440), (24, 40), 0.45),
    ("decode burst", "burst", (32, 64), (160, 220), 0.35),
    ("prompt-heavy 2", "prompt", (380, 440), (24, 40), 0.45),
)
PHASE_S = 180.0
SYSTEMS = {  # name -> (application, its arguments on top of bench.compare's COMMON)
    "static": COMPARE_SYSTEMS["disagg-pull"],
    "colocated": COMPARE_SYSTEMS["colocated"],
    "elastic": (
        "disagg",
        {
            "transport.mode": "pull",
            "autoscaling.enabled": "true",
            "autoscaling.policy": "default",
            "autoscaling.replica_scaling": "false",  # lending alone: fixed 1 + 1 (replica counts: bench.scaling)
        },
    ),
}
POLL_S = 1.0  # GET /admin/autoscaler period while the elastic system runs
PROBE_TOKENS = 32  # output tokens of the calibration probes (as bench.compare)
# the interference floor
FLOOR_BATCH = 8
FLOOR_ROUNDS = 4  # alternating idle / beside-prefill rounds
FLOOR_PREFILL_TOKENS = 400
FLOOR_DECODE_PROMPT = 64
FLOOR_STREAMS = 8
FLOOR_STREAM_TOKENS = 400  # long enough to outlast the probes
FLOOR_PROBES = 3  # probes (64 output tokens each) idle, then beside the streams
DOC = Path("docs/benchmarks")


@dataclass(frozen=True)
class TraceRequest:
    phase: int  # index into the phases
    arrival_s: float  # offset from the trace's start
    request: BenchRequest


# ---- the trace --------------------------------------------------------------------------------


def make_phases(phase_s: float) -> tuple[Phase, ...]:
    return tuple(
        Phase(name, kind, prompt, output, rate, i * phase_s, (i + 1) * phase_s)
        for i, (name, kind, prompt, output, rate) in enumerate(PHASES)
    )


def make_trace(tokenizer, phases: tuple[Phase, ...], seed: int) -> list[TraceRequest]:
    """Poisson arrivals in each phase, lengths uniform in the phase's ranges; seeded."""
    import numpy as np

    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer)
    trace = []
    for index, phase in enumerate(phases):
        length_s = phase.end_s - phase.start_s
        enough = int(3 * phase.rate * length_s) + 20  # far more than the phase holds
        offsets = [t for t in arrival_times(enough, phase.rate, seed=seed + index) if t < length_s]
        for offset in offsets:
            prompt_len = int(rng.integers(phase.prompt_tokens[0], phase.prompt_tokens[1] + 1))
            output = int(rng.integers(phase.output_tokens[0], phase.output_tokens[1] + 1))
            text_offset = int(rng.integers(0, 10_000))
            if phase.kind == "prompt":
                prompt = builder.summarization(prompt_len, text_offset)
            else:
                prompt = builder.code(prompt_len, text_offset)
            trace.append(TraceRequest(index, float(phase.start_s + offset), BenchRequest(prompt, prompt_len, output)))
    return trace


def load_tokenizer():
    from engine.loader import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec())


# ---- calibration and warm-up ------------------------------------------------------------------


def calibrate(target: Target, trace: list[TraceRequest], phases: tuple[Phase, ...]) -> Calibration:
    """Each class's median request, one at a time on the idle colocated system."""
    classes = {}
    for kind in dict.fromkeys(p.kind for p in phases):
        requests = [t.request for t in trace if phases[t.phase].kind == kind]
        base = uncontended(target, median_request(requests), max_tokens=PROBE_TOKENS)
        classes[kind] = ClassCalibration(base["prompt_tokens"], base["ttft_s"], base["tpot_s"])
        print(f"calibration {kind}: {base}", file=sys.stderr)
    return Calibration(classes=classes, model=target.model)


def warm_up(target: Target, trace: list[TraceRequest], phases: tuple[Phase, ...]) -> None:
    """Two short requests of each class through every path (not counted)."""
    kinds = dict.fromkeys(phases[t.phase].kind for t in trace)
    for kind in kinds:
        request = next(t.request for t in trace if phases[t.phase].kind == kind)
        probe = BenchRequest(request.prompt, request.prompt_tokens, 4)
        records, _ = asyncio.run(run(target, [probe, probe], [0.0, 0.0], progress=False))
        bad = [r.error for r in records if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up request failed: {bad[0]}")


# ---- one system --------------------------------------------------------------------------------


def system_args(system: str, calibration: Calibration, raw: Path) -> dict[str, str]:
    application, extra = SYSTEMS[system]
    args = {**COMMON, **extra}
    if system == "elastic":
        args["slo.ttft_ms"] = f"{calibration.controller_ttft_s * 1e3:.1f}"
        args["slo.tpot_ms"] = f"{calibration.tpot_slo_s * 1e3:.1f}"
        args["autoscaling.record"] = str((raw / "trace.jsonl").resolve())
    return args


def run_system(
    target: Target, system: str, trace: list[TraceRequest], phases: tuple[Phase, ...], command: str
) -> SystemRun:
    """The whole trace on ``target``; the elastic system's autoscaler polled meanwhile."""
    started = time.time()
    warm_up(target, trace, phases)
    requests, offsets = [t.request for t in trace], [t.arrival_s for t in trace]
    records, duration, timeline, decisions, t0 = asyncio.run(
        drive(target, requests, offsets, system, poll=system == "elastic")
    )
    rows = [
        {
            "phase": t.phase,
            "arrival_s": round(t.arrival_s, 4),
            "sent_s": round(r.sent - t0, 4),
            "record": r.to_json(),
        }
        for t, r in zip(trace, records)
    ]
    return SystemRun(
        system=system,
        command=command,
        elapsed_s=time.time() - started,
        duration_s=duration,
        rows=rows,
        timeline=timeline,
        decisions=decisions,
    )


async def drive(target: Target, requests: list[BenchRequest], offsets: list[float], label: str, poll: bool):
    """``bench.serve.run`` of the trace, with ``GET /admin/autoscaler`` polled every
    ``POLL_S`` beside it. Returns the records, the duration, the polls, the decisions and
    the run's start on ``time.perf_counter``'s clock."""
    timeline: list[dict] = []
    decisions: dict[tuple, dict] = {}
    stop = asyncio.Event()
    t0, wall0 = time.perf_counter(), time.time()
    poller = asyncio.create_task(poll_autoscaler(target.url, t0, wall0, stop, timeline, decisions)) if poll else None
    records, duration = await run(target, requests, offsets, label)
    stop.set()
    if poller is not None:
        await poller
    return records, duration, timeline, sorted(decisions.values(), key=lambda d: d["t"]), t0


async def poll_autoscaler(
    url: str, t0: float, wall0: float, stop: asyncio.Event, timeline: list[dict], decisions: dict[tuple, dict]
) -> None:
    """Append one sample per poll to ``timeline``; collect every decision seen (by key)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            tick = time.perf_counter()
            try:
                view = (await client.get(url + "/admin/autoscaler")).json()
            except (httpx.HTTPError, ValueError) as exc:
                print(f"autoscaler poll failed: {exc}", file=sys.stderr)
            else:
                timeline.append(timeline_sample(view, tick - t0))
                for d in view.get("decisions", []):
                    key = (d["monotonic_s"], d["action"], d["replica"])
                    decisions[key] = {"t": round(d["time"] - wall0, 2), **d}
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, POLL_S - (time.perf_counter() - tick)))
            except TimeoutError:
                pass


def timeline_sample(view: dict, t: float) -> dict:
    """One poll, without the decisions (those are kept once each)."""
    replicas = [
        {"deployment": r["deployment"], "replica": r["replica_id"], "role": r["role"], **r["load"]}
        for r in view.get("replicas", [])
    ]
    ingress = view.get("ingress", {})
    return {
        "t": round(t, 2),
        "replicas": replicas,
        "in_flight": ingress.get("in_flight", {}),
        "observed": view.get("observed", {}),
    }


# ---- stage: run --------------------------------------------------------------------------------


def stage_run(options: Options, command: str) -> None:
    """Calibrate on the colocated system (or take the raw folder's calibration when
    colocated is not run), then run each system; the report is rewritten after each."""
    phases = make_phases(options.phase_s)
    trace = make_trace(load_tokenizer(), phases, options.seed)
    save_trace(options.raw, phases, options.seed, command)
    per_phase = [sum(t.phase == i for t in trace) for i in range(len(phases))]
    print(f"trace: {len(trace)} requests, per phase {per_phase}", file=sys.stderr)
    calibration = None if "colocated" in options.systems else load_calibration(options.raw)
    order = [s for s in SYSTEMS if s in options.systems]
    if calibration is None:  # the colocated system first: it is calibrated on
        order = ["colocated", *(s for s in order if s != "colocated")]
    for index, system in enumerate(order):
        application = SYSTEMS[system][0]
        args = system_args(system, calibration, options.raw) if calibration else {**COMMON, **SYSTEMS[system][1]}
        if system == "elastic":
            (options.raw / "trace.jsonl").unlink(missing_ok=True)
        with Server(application, args, index) as server:
            target = Target(server.url, server.model())
            if calibration is None:
                calibration = calibrate(target, trace, phases)
                save_calibration(options.raw, calibration)
            if system not in options.systems:
                continue
            result = run_system(target, system, trace, phases, command)
        save_json(options.raw / f"system_{system}.json", asdict(result))
        print_scores(options.raw, system)
        write_report(load_raw(options.raw), options.out)


def print_scores(raw: Path, system: str) -> None:
    from bench.elastic_report import phase_scores

    report = load_raw(raw)
    scores = phase_scores(report.runs[system], report.phases, report.calibration)
    text = ", ".join(
        f"{name} {s.attainment:.0%} (TTFT p90 {s.ttft_p90_s:.2f} s, TPOT p90 {s.tpot_p90_s * 1e3:.0f} ms)"
        for name, s in scores.items()
    )
    print(f"{system}: attainment {text}", file=sys.stderr)


# ---- stage: the interference floor --------------------------------------------------------------


def stage_floor(options: Options, command: str) -> None:
    """(a)/(b) in a subprocess (no Ray in it), then (c)/(d) through the static app."""
    print("floor: engine steps (a, b)...", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.elastic", "--floor-worker", str(options.floor_steps)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    engine = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"floor engine: {engine}", file=sys.stderr)
    print("floor: through the static app (c, d)...", file=sys.stderr, flush=True)
    served = serve_floor(index=len(SYSTEMS) + 1)
    print(f"floor served: {served}", file=sys.stderr)
    floor = Floor(command=command, **engine, **served)
    save_json(options.raw / "floor.json", asdict(floor))


def engine_floor(steps: int) -> dict:
    """A batch of ``FLOOR_BATCH`` decodes on one EngineCore (1 thread), stepped in
    alternating rounds: with the other process idle, and while it prefills back to back."""
    import torch

    torch.set_num_threads(1)
    from bench import elastic  # the worker's function by its module name (this may run as __main__)

    core = _floor_core()
    ctx = multiprocessing.get_context("spawn")
    busy, working, stop, times = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    worker = ctx.Process(target=elastic.prefill_loop, args=(busy, working, stop, times))
    worker.start()
    try:
        busy.set()
        alone = [times.get(timeout=300) for _ in range(4)][1:]  # the first warms up
        busy.clear()
        _start_decodes(core, max_tokens=2 * steps + 16)
        idle, beside, idle_cores, beside_cores = [], [], [], []
        per_round = max(1, steps // FLOOR_ROUNDS)
        for _ in range(FLOOR_ROUNDS):
            busy.clear()
            while working.is_set():
                time.sleep(0.01)
            idle += _timed_steps(core, per_round, idle_cores)
            busy.set()
            working.wait(60)
            beside += _timed_steps(core, per_round, beside_cores)
        busy.clear()
        contended = _drain(times)
    finally:
        stop.set()
        busy.set()
        worker.join(60)
    return {
        "batch": FLOOR_BATCH,
        "rounds": FLOOR_ROUNDS,
        "steps": len(idle),
        "prefill_prompt_tokens": FLOOR_PREFILL_TOKENS,
        "decode_step_idle_ms": statistics.median(idle) * 1e3,
        "decode_step_with_prefill_ms": statistics.median(beside) * 1e3,
        "prefill_alone_s": statistics.median(alone),
        "prefill_beside_decode_s": statistics.median(contended) if contended else math.nan,
        "busy_cores_idle": statistics.mean(idle_cores),
        "busy_cores_with_prefill": statistics.mean(beside_cores),
    }


def _floor_core():
    from engine.config import EngineConfig
    from engine.core import EngineCore

    return EngineCore.from_spec(config=EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_bytes=384 << 20))


def _start_decodes(core, max_tokens: int) -> None:
    """Admit the batch and step until every request is decoding."""
    from engine.params import GenerationRequest, SamplingParams

    builder = PromptBuilder(core.tokenizer)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(FLOOR_BATCH):
        prompt = builder.code(FLOOR_DECODE_PROMPT, 37 * i)
        core.add_request(GenerationRequest(f"d{i}", tuple(prompt), sampling))
    while core.stats().num_queued_prompt_tokens:  # every prompt computed: the batch decodes
        core.step()
    for _ in range(3):  # warm-up
        core.step()


def _timed_steps(core, num: int, busy_cores: list[float]) -> list[float]:
    """``num`` decode steps' seconds; appends the machine's busy cores meanwhile (all
    processes: about 1 alone, 2 beside the prefills; more means a stranger was running)."""
    times = []
    busy0, total0 = _cpu_ticks()
    for _ in range(num):
        start = time.perf_counter()
        outputs = core.step()
        times.append(time.perf_counter() - start)
        if len(outputs) != FLOOR_BATCH:
            raise RuntimeError(f"decode step made {len(outputs)} tokens, expected {FLOOR_BATCH}")
    busy1, total1 = _cpu_ticks()
    busy_cores.append((busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1))
    return times


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (/proc/stat; idle and iowait are not busy)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _drain(queue) -> list[float]:
    values = []
    while not queue.empty():
        values.append(queue.get())
    return values


def prefill_loop(busy, working, stop, times) -> None:
    """The other process: while ``busy`` is set, prefill a ``FLOOR_PREFILL_TOKENS`` prompt
    after another (``working`` set during each) and put each one's seconds on ``times``."""
    import torch

    torch.set_num_threads(1)
    from engine.params import GenerationRequest, SamplingParams

    core = _floor_core()
    prompt = tuple(PromptBuilder(core.tokenizer).summarization(FLOOR_PREFILL_TOKENS, 0))
    number = 0
    while not stop.is_set():
        if not busy.wait(0.1) or stop.is_set():
            continue
        working.set()
        if not busy.is_set():  # cleared meanwhile: the decoder may have seen `working` clear
            working.clear()
            continue
        start = time.perf_counter()
        core.add_request(GenerationRequest(f"p{number}", prompt, SamplingParams(max_tokens=1, temperature=0)))
        while core.has_work():
            core.step()
        times.put(time.perf_counter() - start)
        number += 1
        working.clear()


def serve_floor(index: int) -> dict:
    """(c) the client's TPOT of one stream through the static app, idle, and (d) beside
    ``FLOOR_STREAMS`` long streams; with the decode replica's median engine step after each
    probe (read at once: the machine's speed drifts)."""
    from ray import serve

    builder = PromptBuilder(load_tokenizer())
    probe = BenchRequest(builder.code(48, 0), 48, 64)
    streams = [BenchRequest(builder.code(48, 101 * (i + 1)), 48, FLOOR_STREAM_TOKENS) for i in range(FLOOR_STREAMS)]
    application, extra = SYSTEMS["static"]
    with Server(application, {**COMMON, **extra}, index) as server:
        target = Target(server.url, server.model())
        decode = serve.get_deployment_handle("DecodeServer", app_name="bench")
        return asyncio.run(_served_probes(target, probe, streams, decode))


async def _served_probes(target: Target, probe: BenchRequest, streams: list[BenchRequest], decode) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await send(client, target, probe)  # warm-up
        idle = [await _probe(client, target, probe, decode) for _ in range(FLOOR_PROBES)]
        tasks = [asyncio.create_task(send(client, target, s)) for s in streams]
        try:
            deadline = time.monotonic() + 120
            while (await decode.stats.remote()).num_running < len(streams):
                if time.monotonic() > deadline:
                    raise RuntimeError("the background streams never all reached the decode replica")
                await asyncio.sleep(0.2)
            loaded = [await _probe(client, target, probe, decode) for _ in range(FLOOR_PROBES)]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "streams": FLOOR_STREAMS,
        "client_tpot_idle_ms": statistics.median(t for t, _ in idle),
        "replica_step_idle_ms": statistics.median(s for _, s in idle),
        "client_tpot_loaded_ms": statistics.median(t for t, _ in loaded),
        "replica_step_loaded_ms": statistics.median(s for _, s in loaded),
    }


async def _probe(client: httpx.AsyncClient, target: Target, probe: BenchRequest, decode) -> tuple[float, float]:
    """One probe's client TPOT and, right after it, the decode replica's median step (ms)."""
    record = await send(client, target, probe)
    if not record.ok:
        raise RuntimeError(f"floor probe failed: {record.error}")
    return record.tpot * 1e3, (await decode.stats.remote()).median_step_ms


# ---- the command line --------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The command line, checked."""

    phase_s: float
    systems: tuple[str, ...]
    stage: str
    seed: int
    floor_steps: int
    out: Path
    raw: Path


def parse_options(argv: list[str] | None = None) -> tuple[Options, int | None]:
    """The options, and ``--floor-worker``'s step count (internal: the floor's subprocess)."""
    parser = argparse.ArgumentParser(prog="bench.elastic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=PHASE_S, help="length of each of the 3 phases (s)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--stage", choices=("all", "floor", "run", "report"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-steps", type=int, default=100, help="decode steps timed per floor condition")
    parser.add_argument("--out", default=str(DOC), help="folder for elastic.md/json/png")
    parser.add_argument("--raw", default="/tmp/elastic_raw", help="folder for the raw records (not committed)")
    parser.add_argument("--floor-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not FLOOR_ROUNDS <= args.floor_steps <= 200:  # 2 x steps decode tokens must fit the context
        sys.exit(f"--floor-steps must be in [{FLOOR_ROUNDS}, 200]")
    systems = tuple(s for s in args.systems.split(",") if s)
    for name in systems:
        if name not in SYSTEMS:
            sys.exit(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    options = Options(
        phase_s=args.phase_s,
        systems=systems,
        stage=args.stage,
        seed=args.seed,
        floor_steps=args.floor_steps,
        out=Path(args.out),
        raw=Path(args.raw),
    )
    return options, args.floor_worker


def main(argv: list[str] | None = None) -> None:
    options, floor_worker = parse_options(argv)
    if floor_worker is not None:
        print(json.dumps(engine_floor(floor_worker)))
        return
    command = "python -m bench.elastic" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    options.raw.mkdir(parents=True, exist_ok=True)
    if options.stage in ("all", "floor"):
        stage_floor(options, command)
    if options.stage in ("all", "run"):
        stage_run(options, command)
    write_report(load_raw(options.raw), options.out)


if __name__ == "__main__":
    main()
