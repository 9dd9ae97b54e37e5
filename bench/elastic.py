"""Elastic prefill/decode on a phase-changing trace: ``python -m bench.elastic``.

One trace (prompt-heavy, a decode-heavy burst, prompt-heavy again) through three systems, each in its
own fresh local Ray: ``static`` (1 prefill + 1 decode), ``colocated`` (2 replicas doing both) and
``elastic`` (the default policy lending the prefill replica), with SLOs from the idle colocated
system. Stages: ``floor`` (a decode step beside a prefill, in the engine and through Serve), ``run``
(the systems), ``report`` (``elastic.{json,md,png}`` in ``--out`` from the raw folder); ``all``."""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

from app.local_cluster import Server
from bench.calibrate_planner import core as served_engine  # the engine as bench.compare serves it
from bench.compare import COMMON, ELASTIC, TPOT_SLO_X, TTFT_SLO_X
from bench.compare import SYSTEMS as COMPARE_SYSTEMS
from bench.engine import drain, greedy_request, prefilled
from bench.host import cpu_ticks, machine, timed, tokenizer, worker_json
from bench.report import arguments, cells, command_line, figure, publish, read_json, subset, table, write_json
from bench.serve import Target, arrival_times, client, polled, run, send, uncontended, warm_up
from bench.slo import SLO, RequestRecord, distribution
from workloads import BenchRequest, PromptBuilder, median_request

NAME = "bench.elastic"
# name, request class (its TTFT SLO), prompt and output tokens (inclusive ranges), req/s: set for the
# 2-core machine so that static 1 + 1 keeps its SLOs in the prompt phases and the burst needs more
# than one decode replica (docs/benchmarks/elastic.md)
PHASES = (
    ("prompt-heavy 1", "prompt", (380, 440), (24, 40), 0.45),
    ("decode burst", "burst", (32, 64), (160, 220), 0.35),
    ("prompt-heavy 2", "prompt", (380, 440), (24, 40), 0.45),
)
PHASE_S = 180.0
SYSTEMS = {  # name -> (application, its arguments on top of bench.compare's COMMON)
    "static": COMPARE_SYSTEMS["disagg-pull"],
    "colocated": COMPARE_SYSTEMS["colocated"],
    "elastic": ("disagg", {**ELASTIC, "autoscaling.policy": "default"}),  # lending alone (counts: bench.scaling)
}
PROBE_TOKENS = 32  # output tokens of the calibration probes (as bench.compare)
FLOOR_BATCH, FLOOR_ROUNDS = 8, 4  # decodes stepped; alternating idle / beside-prefill rounds
FLOOR_PREFILL_TOKENS, FLOOR_DECODE_PROMPT = 400, 64
FLOOR_STREAMS, FLOOR_STREAM_TOKENS = 8, 400  # long enough to outlast the probes
FLOOR_PROBES = 3  # probes (64 output tokens each) idle, then beside the streams
BIN_S = 15.0  # attainment bins of the timeline
COLOURS = {"static": "tab:blue", "colocated": "tab:orange", "elastic": "tab:purple"}
OVERALL_MARGIN, BURST_MARGIN = 0.10, 0.20  # the targets: elastic ahead by this much attainment
FLOOR_ROWS = (
    ("(a) EngineCore decode step, batch {batch}, the other core idle", "{decode_step_idle_ms:.1f} ms"),
    ("(b) the same while another process prefills {prefill_prompt_tokens}-token prompts back to back",
     "{decode_step_with_prefill_ms:.1f} ms ({slowdown:+.0%})"),
    ("the machine's busy cores (all processes, /proc/stat) during (a) / (b)",
     "{busy_cores_idle:.2f} / {busy_cores_with_prefill:.2f}"),
    ("that process's {prefill_prompt_tokens}-token prefill: alone / beside the decode steps",
     "{prefill_alone_s:.2f} s / {prefill_beside_decode_s:.2f} s"),
    ("(c) client TPOT, one stream through the static disagg_app, idle (decode replica's engine step)",
     "{client_tpot_idle_ms:.1f} ms ({replica_step_idle_ms:.1f} ms)"),
    ("(d) the same beside {streams} other streams (decode replica's engine step)",
     "{client_tpot_loaded_ms:.1f} ms ({replica_step_loaded_ms:.1f} ms)"),
)  # fmt: skip


@dataclass(frozen=True)
class Phase:
    """Poisson arrivals at ``rate`` (req/s) from ``start_s`` to ``end_s``; ``kind``: its request class."""

    name: str
    kind: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    rate: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Calibration:
    """Each class's median request alone on the idle colocated system: a TTFT SLO each, one TPOT SLO."""

    classes: dict[str, dict[str, float]]
    model: str

    def slo(self, kind: str) -> SLO:
        tpot_s = statistics.mean(c["tpot_s"] for c in self.classes.values())
        return SLO(TTFT_SLO_X * self.classes[kind]["ttft_s"], TPOT_SLO_X * tpot_s)


@dataclass(frozen=True)
class SystemRun:
    """One system's run: a row per request, the autoscaler's polls (``timeline``) and ``decisions``."""

    system: str
    command: str
    elapsed_s: float
    duration_s: float
    rows: list[dict]
    timeline: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)


def make_phases(phase_s: float) -> tuple[Phase, ...]:
    return tuple(Phase(*p, i * phase_s, (i + 1) * phase_s) for i, p in enumerate(PHASES))


def make_trace(words, phases: tuple[Phase, ...], seed: int) -> list[tuple[int, float, BenchRequest]]:
    """(phase index, arrival offset, request), seeded."""
    import numpy as np

    rng, builder, trace = np.random.default_rng(seed), PromptBuilder(words), []
    for index, phase in enumerate(phases):
        length_s = phase.end_s - phase.start_s
        enough = int(3 * phase.rate * length_s) + 20  # far more than the phase holds
        for offset in [t for t in arrival_times(enough, phase.rate, seed=seed + index) if t < length_s]:
            prompt_len = int(rng.integers(phase.prompt_tokens[0], phase.prompt_tokens[1] + 1))
            output = int(rng.integers(phase.output_tokens[0], phase.output_tokens[1] + 1))
            make = builder.summarization if phase.kind == "prompt" else builder.code
            prompt = make(prompt_len, int(rng.integers(0, 10_000)))
            trace.append((index, float(phase.start_s + offset), BenchRequest(prompt, prompt_len, output)))
    return trace


def by_class(trace: list, phases: tuple[Phase, ...]) -> dict[str, list[BenchRequest]]:
    classes: dict[str, list[BenchRequest]] = {}
    for index, _, request in trace:
        classes.setdefault(phases[index].kind, []).append(request)
    return classes


def system_args(system: str, calibration: Calibration | None, record: Path | None = None) -> dict[str, str]:
    """``system``'s arguments: the elastic controller's with the SLOs and a fresh ``record`` file."""
    args = {**COMMON, **SYSTEMS[system][1]}
    if system == "elastic" and calibration is not None:
        slo = calibration.slo("prompt")  # the controller's one TTFT target: its TTFT signals are about prefill
        args |= {"slo.ttft_ms": f"{slo.ttft_s * 1e3:.1f}", "slo.tpot_ms": f"{slo.tpot_s * 1e3:.1f}"}
        if record is not None:
            record.unlink(missing_ok=True)
            args["autoscaling.record"] = str(record.resolve())
    return args


def each_system(
    systems: list[str], calibration: Calibration | None, classes: dict, record: Path | None = None
) -> Iterator[tuple[str, Target, Calibration]]:
    """(name, target, calibration) per system in its own Server, calibrated first on idle colocated: each
    class's median request alone (``PROBE_TOKENS`` output tokens)."""
    order = [None, *systems] if calibration is None and "colocated" not in systems[:1] else list(systems)
    for index, system in enumerate(order):
        name = system or "colocated"
        with Server(SYSTEMS[name][0], system_args(name, calibration, record), index) as server:
            target = Target(server.url, server.model())
            if calibration is None:
                found = {k: uncontended(target, median_request(r), max_tokens=PROBE_TOKENS) for k, r in classes.items()}
                print(f"calibration: {found}", file=sys.stderr)
                calibration = Calibration(found, target.model)
            if system is not None:
                yield system, target, calibration


def stage_run(options: argparse.Namespace, command: str) -> None:
    """Each system, colocated first (or the raw folder's calibration): the whole trace after a warm-up of each
    class, the elastic system's autoscaler polled meanwhile; the report rewritten after each."""
    phases = make_phases(options.phase_s)
    trace = make_trace(tokenizer(), phases, options.seed)
    save_raw(options.raw, "trace", {"seed": options.seed, "command": command, "phases": [asdict(p) for p in phases]})
    known = None if "colocated" in options.systems else load_raw(options.raw)["calibration"]
    order = sorted((s for s in SYSTEMS if s in options.systems), key=lambda s: s != "colocated")
    classes, requests, arrivals = by_class(trace, phases), [r for *_, r in trace], [a for _, a, _ in trace]
    for system, target, calibration in each_system(order, known, classes, options.raw / "trace.jsonl"):
        save_raw(options.raw, "calibration", calibration)
        started = time.time()
        warm_up(target, [rs[0] for rs in classes.values()])
        replay = lambda _, target=target, system=system: run(target, requests, arrivals, system)  # noqa: E731
        (records, duration), timeline, decisions, (t0, _) = polled(target.url, replay, poll=system == "elastic")
        rows = [{"phase": i, "arrival_s": round(a, 4), "sent_s": round(r.sent - t0, 4), "record": r.to_json()}
                for (i, a, _), r in zip(trace, records)]  # fmt: skip
        result = SystemRun(system, command, time.time() - started, duration, rows, timeline, decisions)
        save_raw(options.raw, f"system_{system}", result)
        scores = phase_scores(result, phases, calibration).items()
        print(f"{system}: attainment " + ", ".join(f"{n} {s['attainment']:.0%}" for n, s in scores), file=sys.stderr)
        write_report(load_raw(options.raw), options.out)


def engine_floor(steps: int, rounds: int = FLOOR_ROUNDS, distinct: bool = False) -> dict:
    """``FLOOR_BATCH`` decodes on one EngineCore, in rounds: another process idle, then prefilling back to
    back (the same prompt, or with ``distinct`` a new one each time and no prefix cache on either side)."""
    from bench import elastic  # the worker's function by its module name (this may run as __main__)

    core, ctx = served_engine(prefix_caching=not distinct), multiprocessing.get_context("spawn")
    builder = PromptBuilder(core.tokenizer)
    busy, working, stop, times = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    worker = ctx.Process(target=elastic.prefill_loop, args=(busy, working, stop, times, distinct))
    worker.start()
    step_s, cores = {"idle": [], "beside": []}, {"idle": [], "beside": []}
    try:
        busy.set()
        alone = [times.get(timeout=300) for _ in range(4)][1:]  # the first warms up
        busy.clear()
        prompts = [builder.code(FLOOR_DECODE_PROMPT, 37 * i) for i in range(FLOOR_BATCH)]
        prefilled(core, [greedy_request(f"d{i}", p, 2 * steps + 16) for i, p in enumerate(prompts)], warm=3)
        for _ in range(rounds):
            busy.clear()
            while working.is_set():
                time.sleep(0.01)
            step_s["idle"] += _timed_steps(core, max(1, steps // rounds), cores["idle"])
            busy.set()
            working.wait(60)
            step_s["beside"] += _timed_steps(core, max(1, steps // rounds), cores["beside"])
        busy.clear()
        contended = [times.get() for _ in iter(times.empty, True)]  # until the queue is empty
    finally:
        stop.set()
        busy.set()
        worker.join(60)
    return {"batch": FLOOR_BATCH, "rounds": rounds, "steps": len(step_s["idle"]),
            "prefill_prompt_tokens": FLOOR_PREFILL_TOKENS,
            "decode_step_idle_ms": statistics.median(step_s["idle"]) * 1e3,
            "decode_step_with_prefill_ms": statistics.median(step_s["beside"]) * 1e3,
            "prefill_alone_s": statistics.median(alone),
            "prefill_beside_decode_s": statistics.median(contended) if contended else math.nan,
            "busy_cores_idle": statistics.mean(cores["idle"]),
            "busy_cores_with_prefill": statistics.mean(cores["beside"])}  # fmt: skip


def _timed_steps(core, num: int, busy_cores: list[float]) -> list[float]:
    """``num`` decode steps' seconds; the machine's busy cores meanwhile appended (a stranger shows)."""
    times, (busy0, total0, _) = [], cpu_ticks()
    for _ in range(num):
        outputs, took = timed(core.step)
        times.append(took)
        if len(outputs) != FLOOR_BATCH:
            raise RuntimeError(f"decode step made {len(outputs)} tokens, expected {FLOOR_BATCH}")
    busy1, total1, _ = cpu_ticks()
    busy_cores.append((busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1))
    return times


def prefill_loop(busy, working, stop, times, distinct: bool = False) -> None:
    """The other process: while ``busy``, prefill prompt after prompt (``working`` during each), timed."""
    core, number = served_engine(prefix_caching=not distinct), 0
    builder = PromptBuilder(core.tokenizer)
    while not stop.is_set():
        if not busy.wait(0.1) or stop.is_set():
            continue
        working.set()
        if not busy.is_set():  # cleared meanwhile: the decoder may have seen `working` clear
            working.clear()
            continue
        prompt = builder.summarization(FLOOR_PREFILL_TOKENS, 997 * number if distinct else 0)
        start = time.perf_counter()
        core.add_request(greedy_request(f"p{number}", prompt, 1, ignore_eos=False))
        drain(core)
        times.put(time.perf_counter() - start)
        number += 1
        working.clear()


def serve_floor(index: int) -> dict:
    """Client TPOT through the static app, idle and beside long streams, with the decode replica's step."""
    from ray import serve

    builder = PromptBuilder(tokenizer())
    probe = BenchRequest(builder.code(48, 0), 48, 64)
    streams = [BenchRequest(builder.code(48, 101 * (i + 1)), 48, FLOOR_STREAM_TOKENS) for i in range(FLOOR_STREAMS)]
    with Server(SYSTEMS["static"][0], system_args("static", None), index) as server:
        decode = serve.get_deployment_handle("DecodeServer", app_name="bench")
        return asyncio.run(_served_probes(Target(server.url, server.model()), probe, streams, decode))


async def _served_probes(target: Target, probe: BenchRequest, streams: list[BenchRequest], decode) -> dict:
    async def probes(load: str) -> dict:
        found = []
        for _ in range(FLOOR_PROBES):
            record = await send(http, target, probe)
            if not record.ok:
                raise RuntimeError(f"floor probe failed: {record.error}")
            found.append((record.tpot * 1e3, (await decode.stats.remote()).median_step_ms))
        return {f"client_tpot_{load}_ms": statistics.median(t for t, _ in found),
                f"replica_step_{load}_ms": statistics.median(s for _, s in found)}  # fmt: skip

    async with client() as http:
        await send(http, target, probe)  # warm-up
        idle = await probes("idle")
        tasks = [asyncio.create_task(send(http, target, s)) for s in streams]
        try:
            async with asyncio.timeout(120):  # until every background stream reached the decode replica
                while (await decode.stats.remote()).num_running < len(streams):
                    await asyncio.sleep(0.2)
            loaded = await probes("loaded")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": FLOOR_STREAMS, **idle, **loaded}


def save_raw(raw: Path, name: str, data) -> None:
    write_json(raw / f"{name}.json", asdict(data) if is_dataclass(data) else data, indent=None)


def load_raw(raw: Path) -> dict:
    """The report's input, as the stages left it in ``raw`` (each part None or empty until its stage ran)."""
    found, ranges = {path.stem: read_json(path) for path in raw.glob("*.json")}, ("prompt_tokens", "output_tokens")
    trace, calibration = found.get("trace", {}), found.get("calibration") and Calibration(**found["calibration"])
    phases = tuple(Phase(**p | {k: tuple(p[k]) for k in ranges}) for p in trace.get("phases", []))
    runs = {s: SystemRun(**found[f"system_{s}"]) for s in SYSTEMS if f"system_{s}" in found}
    return {"phases": phases, "seed": trace.get("seed", 0), "command": trace.get("command", ""),
            "calibration": calibration, "runs": runs, "floor": found.get("floor")}  # fmt: skip


def score(judged: list[tuple[dict, RequestRecord, SLO]]) -> dict:
    """Of (row, record, its SLO) triples: attainment (a failed request is a miss) and p90 latencies."""
    done = [r for _, r, _ in judged if r.ok]
    met = sum(slo.met(r) for _, r, slo in judged)
    ttft, tpot = distribution([r.ttft for r in done]), distribution([t for r in done if (t := r.tpot) is not None])
    return {"requests": len(judged), "failed": len(judged) - len(done),
            "attainment": met / len(judged) if judged else math.nan,
            "ttft_p90_s": ttft["p90"], "tpot_p90_s": tpot["p90"]}  # fmt: skip


def _judged(run: SystemRun, phases: tuple[Phase, ...], calibration: Calibration) -> list:
    slos = [calibration.slo(phases[row["phase"]].kind) for row in run.rows]
    return [(row, RequestRecord.from_json(row["record"]), slo) for row, slo in zip(run.rows, slos)]


def phase_scores(run: SystemRun, phases: tuple[Phase, ...], calibration: Calibration) -> dict[str, dict]:
    judged = _judged(run, phases, calibration)
    scores = {phase.name: score([j for j in judged if j[0]["phase"] == i]) for i, phase in enumerate(phases)}
    return scores | {"overall": score(judged)}


def binned(rows: list[tuple[float, bool]], bin_s: float, bins: int, empty: float | None = math.nan) -> list:
    """(arrival, met) -> the share met among the arrivals in each ``bin_s`` from 0; ``empty`` for none."""
    groups = [[met for arrival, met in rows if k * bin_s <= arrival < (k + 1) * bin_s] for k in range(bins)]
    return [sum(mine) / len(mine) if mine else empty for mine in groups]


def attainment_bins(
    run: SystemRun, phases: tuple[Phase, ...], calibration: Calibration, bin_s: float = BIN_S
) -> list[tuple[float, float]]:
    """(bin start, attainment of the requests that arrived in it); NaN for an empty bin."""
    met = [(row["arrival_s"], slo.met(r)) for row, r, slo in _judged(run, phases, calibration)]
    bins = math.ceil((phases[-1].end_s if phases else 0.0) / bin_s)
    return [(k * bin_s, share) for k, share in enumerate(binned(met, bin_s, bins))]


def in_flight(run: SystemRun, step_s: float = 1.0) -> tuple[list[float], list[int]]:
    """Requests in flight as the client saw them (sent, not yet ended), every ``step_s``."""
    records = [(row, RequestRecord.from_json(row["record"])) for row in run.rows]
    spans = [(row["sent_s"], row["sent_s"] + r.e2e) for row, r in records if r.chunks or r.last is not None]
    times = [k * step_s for k in range(int(max((b for _, b in spans), default=0.0) / step_s) + 1)]
    return times, [sum(a <= t < b for a, b in spans) for t in times]


def targets(scores: dict[str, dict[str, dict]], burst: str) -> list[tuple[str, float | None, float | None]]:
    """(what, elastic's value, the bar) of each target; None where a system is missing."""

    def share(system: str, phase: str) -> float | None:
        return scores.get(system, {}).get(phase, {}).get("attainment")

    static, colocated, static_burst = share("static", "overall"), share("colocated", "overall"), share("static", burst)
    overall_bar = None if None in (static, colocated) else max(static, colocated) + OVERALL_MARGIN
    burst_bar = None if static_burst is None else static_burst + BURST_MARGIN
    overall, in_burst = share("elastic", "overall"), share("elastic", burst)
    return [
        (f"elastic overall >= max(static, colocated) + {OVERALL_MARGIN * 100:.0f} points", overall, overall_bar),
        (f"elastic in the {burst} >= static + {BURST_MARGIN * 100:.0f} points", in_burst, burst_bar),
    ]


def write_report(report: dict, out: Path) -> None:
    """elastic.json (what the page shows, without the per-request records), elastic.md's block, elastic.png."""
    calibration, phases, runs, scores, slo_s = report["calibration"], report["phases"], report["runs"], {}, None
    if calibration is not None:
        scores = {s: phase_scores(run, phases, calibration) for s, run in runs.items()}
        slo_s = {k: {"ttft": calibration.slo(k).ttft_s, "tpot": calibration.slo(k).tpot_s} for k in calibration.classes}
        slo_s["controller"] = slo_s["prompt"]  # as system_args gives the elastic controller
    burst = next((p.name for p in phases if p.kind == "burst"), "burst")
    summary = {
        "command": report["command"], "machine": machine(), "seed": report["seed"],
        "phases": [asdict(p) for p in phases], "slo_multiples": {"ttft": TTFT_SLO_X, "tpot": TPOT_SLO_X},
        "calibration": None if calibration is None else calibration.classes, "slo_s": slo_s, "results": scores,
        "elapsed_s": {s: run.elapsed_s for s, run in runs.items()},
        "decisions": runs["elastic"].decisions if "elastic" in runs else [],
        "targets": [{"target": t, "value": v, "bar": b} for t, v, b in targets(scores, burst)],
        "floor": report["floor"],
    }  # fmt: skip
    publish(out, "elastic", NAME, summary, render(summary), "# Elastic prefill/decode: a phase-changing trace")
    if calibration is not None and runs:
        plot_timeline(report, out / "elastic.png")


def render(summary: dict) -> list[str]:
    lines = [""]
    if summary["command"]:
        lines += [f"Command: `{summary['command']}`. Machine: {summary['machine']}.", ""]
    lines += _trace_lines(summary)
    if results := summary["results"]:
        names, p90 = [p["name"] for p in summary["phases"]], "{ttft_p90_s:.2f} / {tpot_p90_s:ms.0f}"
        rows = [[s, *(f"{per[n]['attainment']:.0%}" for n in [*names, "overall"]), per["overall"]["failed"],
                 f"{summary['elapsed_s'][s] / 60:.1f}"] for s, per in results.items()]  # fmt: skip
        lines += ["### SLO attainment", "", *table(["system", *names, "overall", "failed", "run (min)"], rows)]
        lines += ["", "p90 latencies per phase, TTFT (s) / TPOT (ms):", ""]
        lines += [*table(["system", *names], [[s, *(cells(p90, per[n]) for n in names)] for s, per in results.items()])]
        rows = []
        for t in summary["targets"]:
            known = t["value"] is not None and t["bar"] is not None
            result = ("ok" if t["value"] >= t["bar"] - 1e-9 else "MISSED") if known else None
            value = t["value"] if known else None
            rows.append(cells("{target} | {value:.0%} | {bar:.0%} | {result}", t | {"value": value, "result": result}))
        caption = ("the elastic prefill replica's role, with its decisions; attainment of the requests arriving in "
                   f"each {BIN_S:g} s; requests in flight (client side)")  # fmt: skip
        lines += ["", *table("target | elastic | bar | result", rows), "", f"![timeline: {caption}](elastic.png)", ""]
    if "elastic" in summary["elapsed_s"]:
        phases, row = summary["phases"], "{t:.1f} | {phase} | {action} | {replica} | {role} | {reason}"
        at = [next((p["name"] for p in phases if p["start_s"] <= d["t"] < p["end_s"]), "after the trace")
              for d in summary["decisions"]]  # fmt: skip
        rows = [cells(row, d | {"phase": phase}) for d, phase in zip(summary["decisions"], at)]
        header = "time (s) | phase | action | replica | role | reason"
        decisions = table(header, rows) if rows else ["No lend or reclaim in this run."]
        lines += ["### The elastic run's decisions", "", *decisions, ""]
    return lines + floor_lines(summary["floor"])


def _trace_lines(summary: dict) -> list[str]:
    if not summary["phases"]:
        return []
    slo_s, first = summary["slo_s"] or {}, next(iter(summary["results"].values()), {})
    row = "{name} | {start_s:.0f}-{end_s:.0f} | {requests} | {prompt_tokens[0]}-{prompt_tokens[1]} | "
    row += "{output_tokens[0]}-{output_tokens[1]} | {rate:g} | {ttft} | {tpot}"
    rows = []
    for p in summary["phases"]:
        slo = slo_s.get(p["kind"])
        ttft, tpot = (f"{slo['ttft']:.2f} s", f"{slo['tpot'] * 1e3:.0f} ms") if slo else (None, None)
        rows.append(cells(row, p | {"requests": first.get(p["name"], {}).get("requests"), "ttft": ttft, "tpot": tpot}))
    header = "phase | time (s) | requests | prompt tokens | output tokens | arrivals (req/s, Poisson) | TTFT SLO"
    lines = ["### Trace and SLOs", "",
             f"Three phases, seed {summary['seed']}: the same requests at the same offsets for every system, streamed "
             "with `ignore_eos` and temperature 0. Prompts are built from real tokens (`workloads.PromptBuilder`: "
             "a document to summarize in the prompt-heavy phases, code to complete in the burst).", "",
             *table(header + " | TPOT SLO", rows), ""]  # fmt: skip
    if summary["calibration"] is None:
        return lines
    x, controller = summary["slo_multiples"], slo_s["controller"]
    row = "{k} | {c[prompt_tokens]} | {c[ttft_s]:.3f} s | {c[tpot_s]:ms.1f} ms | {s[ttft]:.2f} s | {s[tpot]:ms.0f} ms"
    rows = [cells(row, {"k": k, "c": c, "s": slo_s[k]}) for k, c in summary["calibration"].items()]
    header = "class | median prompt (tokens) | uncontended TTFT | uncontended TPOT | TTFT SLO | TPOT SLO"
    return lines + [
        f"SLOs from the idle colocated system, one request at a time (32 output tokens, median of 3): TTFT SLO "
        f"{x['ttft']:g}x the uncontended TTFT of the class's median prompt, TPOT SLO {x['tpot']:g}x the mean "
        "uncontended TPOT of the two classes (one decode step, measured twice; the controller takes one target).", "",
        *table(header, rows), "",
        f"The elastic system's controller gets `slo.ttft_ms={controller['ttft'] * 1e3:.0f}` (the "
        f"prompt class's: the policy has one TTFT target, and its TTFT signals are about the prefill side) and "
        f"`slo.tpot_ms={controller['tpot'] * 1e3:.0f}`.", "",
    ]  # fmt: skip


def floor_lines(floor: dict | None) -> list[str]:
    if floor is None:
        return []
    f = floor | {"slowdown": floor["decode_step_with_prefill_ms"] / floor["decode_step_idle_ms"] - 1}
    head = (f"Command: `{f['command']}`. Medians; (a) and (b) in {f['rounds']} alternating rounds "
            f"({f['steps']} steps per condition), no Serve, no Ray, 1 torch thread per process.")  # fmt: skip
    rows = [cells(f"{label} | {value}", f) for label, value in FLOOR_ROWS]
    lines = ["### Interference floor", "", head, "", *table("measurement | value", rows), ""]
    if f["busy_cores_idle"] > 1.3:  # only the decoding process should run during (a)
        lines += [f"**Not a clean measurement**: {f['busy_cores_idle']:.2f} cores were busy during (a): another "
                  "process shared the machine. Run `--stage floor` again.", ""]  # fmt: skip
    return lines


def mark_spans(axes: list, spans: list[tuple[float, float, str, float]], **label) -> None:
    """Spans (start, end, label, shade) on panels over one time axis, labelled over the first."""
    for ax in axes:
        for start, end, text, shade in spans:
            if shade:
                ax.axvspan(start, end, color="orange", alpha=shade, linewidth=0)
            ax.axvline(start, color="grey", linewidth=0.6, linestyle=":")
            if ax is axes[0]:
                ax.text((start + end) / 2, 1.02, text, transform=ax.get_xaxis_transform(), ha="center", **label)


def lent(sample: dict) -> bool:
    """Whether a poll saw the prefill replica lent (its role ``both``)."""
    return any(r["role"] == "both" for r in sample.get("replicas", []) if r["deployment"] == "PrefillServer")


def plot_timeline(report: dict, path: Path) -> None:
    """The elastic prefill replica's role and decisions, attainment per bin, requests in flight."""
    legend, elastic = {"fontsize": 8, "loc": "upper left"}, report["runs"].get("elastic")
    with figure(path, 3, 1, (11, 8), legend=legend, sharex=True) as (role_ax, bin_ax, flight_ax, _):
        spans = [(p.start_s, p.end_s, p.name, 0.12 if p.kind == "burst" else 0.0) for p in report["phases"]]
        mark_spans([role_ax, bin_ax, flight_ax], spans)
        role_ax.set_yticks([0, 1], ["prefill", "both (lent)"])
        role_ax.set(ylim=(-0.3, 1.3), ylabel="elastic: prefill\nreplica's role")
        if elastic is None or not elastic.timeline:
            role_ax.text(0.5, 0.5, "no elastic run", transform=role_ax.transAxes, ha="center")
        else:
            roles = [float(lent(s)) for s in elastic.timeline]
            role_ax.step([s["t"] for s in elastic.timeline], roles, where="post", color=COLOURS["elastic"])
            for d in elastic.decisions:
                colour = {"lend": "tab:green", "reclaim": "tab:red"}.get(d["action"], "tab:grey")
                role_ax.axvline(d["t"], color=colour, linewidth=1, alpha=0.8)
                role_ax.text(d["t"], 1.15, d["action"], color=colour, fontsize=7, rotation=90, va="bottom", ha="right")
        for system, run in report["runs"].items():
            if bins := attainment_bins(run, report["phases"], report["calibration"]):
                starts, values = zip(*bins)
                ends = [*starts, starts[-1] + BIN_S]
                bin_ax.step(ends, [*values, values[-1]], where="post", label=system, color=COLOURS.get(system))
            flight_ax.plot(*in_flight(run), label=system, linewidth=1, color=COLOURS.get(system))
        bin_ax.set(ylabel=f"SLO attainment\nper {BIN_S:g} s", ylim=(-0.05, 1.05))
        flight_ax.set(ylabel="requests in flight", xlabel="time since the trace's start (s)")


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(NAME, __doc__, "docs/benchmarks", "folder for elastic.md/json/png")
    parser.add_argument("--phase-s", type=float, default=PHASE_S, help="length of each of the 3 phases (s)")
    parser.add_argument("--systems", **subset(SYSTEMS))
    parser.add_argument("--stage", choices=("all", "floor", "run", "report"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-steps", type=int, default=100, help="decode steps timed per floor condition")
    parser.add_argument("--raw", type=Path, default=Path("/tmp/elastic_raw"), help="folder for the raw records")
    options = parser.parse_args(argv)
    if not FLOOR_ROUNDS <= options.floor_steps <= 200:  # 2 x steps decode tokens must fit the context
        sys.exit(f"--floor-steps must be in [{FLOOR_ROUNDS}, 200]")
    return options


def main(argv: list[str] | None = None) -> None:
    options, command = parse_options(argv), command_line(NAME, argv)
    options.raw.mkdir(parents=True, exist_ok=True)
    if options.stage in ("all", "floor"):  # the engine's part in a subprocess (no Ray in it), then the static app
        floor = {"command": command, **worker_json(NAME, "engine_floor", options.floor_steps)}
        save_raw(options.raw, "floor", floor | serve_floor(index=len(SYSTEMS) + 1))
    if options.stage in ("all", "run"):
        stage_run(options, command)
    write_report(load_raw(options.raw), options.out)


if __name__ == "__main__":
    main()
