"""The simulator against the served app: ``python -m bench.planner_check`` (docs/benchmarks/planner.md).

For each system of ``bench.compare`` checked (``colocated``: 2 replicas doing both phases;
``disagg-pull``: 1 prefill + 1 decode, pull, fixed pools), in its own local Ray cluster as
``bench.compare`` starts it, one workload's requests are sent at 30%, 60% and 90% of that
system's goodput measured in docs/benchmarks/goodput.json, twice per rate (the same requests
and arrivals: the spread of the two runs is this machine's run-to-run noise). The simulator,
calibrated on this machine only (``planner/calibration/cpu-2core.json``, written by
``bench.calibrate_planner`` from engine and transfer measurements, its interference
factor and the serving stack measured through the served app), predicts TTFT and TPOT
p50 / p90 for the very same lengths and arrivals
(``planner.simulator.sim_requests`` with the same seed). The serving stack's part is probed on each
system's app just before its runs (``bench.calibrate_planner.probe_stack``: idle-app probes,
batches of 2 and 4, a short load run, all of their own prompts): this machine's speed drifts by more
than the bound within minutes, so a stack probed at calibration time is reported beside it
(``--file-stack`` skips the probe). A prediction agrees when its error against
the mean of the two runs is within max(15%, twice their spread). The app runs with prefix
caching off: the runs repeat the same prompts, which a cache would serve from the previous run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.calibrate_planner import NO_PREFIX_CACHE, cpu_ticks, probe_stack
from bench.compare import COMMON, MAX_MODEL_LEN, SYSTEMS
from bench.ray_local import Server
from bench.serve import Target, run, uncontended
from bench.slo import summarize
from planner.costs import DEFAULT_CALIBRATION, ServingStack, load_calibration
from planner.simulator import SystemSpec, goodput, sim_requests, simulate, uncontended_latency
from workloads import arrival_times, make_requests, median_request

DOC = Path("docs/benchmarks")
GOODPUT = DOC / "goodput.json"
METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))
MIN_BOUND = 0.15


def stack_kind(system: str) -> str:
    """The serving stack's kind (``planner.costs.ServingStack``) of one of ``bench.compare``'s systems."""
    return "disaggregated" if system.startswith("disagg") else "colocated"


def system_spec(system: str, calibration: Path, stack: dict | None = None) -> SystemSpec:
    """The simulated twin of one of ``bench.compare``'s systems (2 engine replicas, 1 core
    each), with the calibration's serving stack or ``stack`` (a probed stack's fields)."""
    cost = load_calibration(calibration)
    served = ServingStack.of(stack) if stack else cost.stack(stack_kind(system))
    base = SystemSpec("colocated", 2, 0, cost, cost, interference=cost.interference, stack=served)
    if system == "colocated":
        return base
    if system == "colocated-chunked":
        return replace(base, chunked_prefill=True, max_num_batched_tokens=256)
    if system == "disagg-pull":
        return replace(base, kind="disaggregated", prefill_replicas=1, decode_replicas=1)
    raise SystemExit(f"no simulated twin of {system!r} (colocated, colocated-chunked, disagg-pull)")


def predict(spec: SystemSpec, workload: str, rate: float, num_requests: int, seed: int) -> dict:
    result = simulate(spec, sim_requests(workload, rate, num_requests, MAX_MODEL_LEN, seed))
    return {m: result.percentiles()[m] for m in ("ttft_s", "tpot_s")}


def measure_system(system: str, workload: str, rates: list[float], options: argparse.Namespace) -> dict:
    """Runs of ``system`` at each rate (``options.runs`` each), in one server session; unless
    ``options.file_stack``, the serving stack is probed on this app first (idle probes, batched
    probes and a short load run of their own prompts, ``bench.calibrate_planner.probe_stack``)."""
    application, extra = SYSTEMS[system]
    with Server(application, {**COMMON, **extra, **NO_PREFIX_CACHE}, index=0) as server:
        target = Target(server.url, server.model())
        requests = make_requests(workload, _tokenizer(), MAX_MODEL_LEN, options.num_requests, options.seed)
        idle = uncontended(target, median_request(requests))  # also warms the replicas up
        print(f"{system}: uncontended {idle}", file=sys.stderr)
        probed = {}
        if not options.file_stack:
            cost = load_calibration(options.calibration)
            probed = {"stack": probe_stack(server.url, target, cost, stack_kind(system))}
        points = []
        for rate in rates:
            offsets = arrival_times(len(requests), rate, seed=options.seed)
            runs = []
            for number in range(options.runs):
                before = cpu_ticks()
                records, duration = asyncio.run(run(target, requests, offsets, f"{system} {rate:.3g}/s #{number + 1}"))
                summary = summarize(records, duration)
                runs.append({m: summary[m] for m in ("ttft_s", "tpot_s", "failed", "duration_s")})
                runs[-1]["other_cores"] = other_cores(before, cpu_ticks())
                print(f"  {system} {rate:.3g}/s run {number + 1}: {_short(summary)}", file=sys.stderr)
            points.append({"rate": rate, "runs": runs})
        return {"uncontended": idle, **probed, "points": points}


def other_cores(before: tuple[int, int, float], after: tuple[int, int, float]) -> float:
    """Cores that processes outside this check used meanwhile (other sessions' tests: the
    replicas run at Ray's worker niceness, 15, so any such process takes CPU from them)."""
    seconds = (after[0] - before[0] - (after[1] - before[1])) / os.sysconf("SC_CLK_TCK")
    return max(seconds, 0.0) / max(after[2] - before[2], 1e-9)


def _tokenizer():
    from engine.loader import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec())


def _short(summary: dict) -> str:
    return ", ".join(f"{m} {p} {summary[m][p]:.3f}" for m, p in METRICS) + f", failed {summary['failed']}"


def compare_point(runs: list[dict], predicted: dict) -> list[dict]:
    """One row per metric: both runs, spread, prediction, error, bound, within."""
    rows = []
    for metric, pct in METRICS:
        values = [r[metric][pct] for r in runs]
        mean = sum(values) / len(values)
        spread = (max(values) - min(values)) / mean if mean else 0.0
        bound = max(MIN_BOUND, 2 * spread)
        guess = predicted[metric][pct]
        error = (guess - mean) / mean if mean else float("inf")
        rows.append(
            {
                "metric": f"{metric.removesuffix('_s')} {pct}",
                "measured": values,
                "mean": mean,
                "spread": spread,
                "predicted": guess,
                "error": error,
                "bound": bound,
                "within": abs(error) <= bound,
            }
        )
    return rows


def simulator_speed(calibration: Path) -> dict:
    """Seconds for simulate() on a 1,000-replica disaggregated system (400 prefill + 600
    decode replicas of this machine's cost, no interference) under chatbot traffic."""
    cost = load_calibration(calibration)
    spec = SystemSpec("disaggregated", 400, 600, cost, cost)
    requests = sim_requests("chatbot", 250.0, 20_000, MAX_MODEL_LEN, seed=0)
    start = time.perf_counter()
    result = simulate(spec, requests)
    seconds = time.perf_counter() - start
    return {
        "replicas": 1000,
        "requests": len(requests),
        "rate": 250.0,
        "output_tokens": sum(r.output_tokens for r in requests),
        "seconds": seconds,
        "ttft_p90_s": result.percentiles()["ttft_s"]["p90"],
    }


def relative_slos(calibration: Path, prompt_tokens: int, multiples: dict[str, float]) -> dict[str, float]:
    """``bench.compare``'s SLOs on the simulated machine: ``multiples`` (5x TTFT, 2x TPOT) of
    the idle colocated system's uncontended latency (one request of the workload's median
    prompt, 32 output tokens). Scaled to the calibration's own speed, as goodput.json's are to
    the speed of the day it was measured on, so the two compare across days of a drifting machine."""
    ttft, tpot = uncontended_latency(system_spec("colocated", calibration), prompt_tokens)
    return {"ttft": multiples["ttft"] * ttft, "tpot": multiples["tpot"] * tpot}


def simulated_goodputs(calibration: Path) -> dict:
    """Per workload of goodput.json: each system's measured goodput and the simulator's, on
    SLOs defined as that benchmark defines them (``relative_slos``), 5 x 80 requests a rate
    (the same method as tests/planner/test_simulator.py)."""
    measured = json.loads(GOODPUT.read_text())
    table = {}
    for workload, systems in measured["results"].items():
        median = measured["calibration"][workload]["prompt_tokens"]
        slo = relative_slos(calibration, median, measured["slo_multiples"])

        def make(rate: float, workload: str = workload) -> list:
            runs = [sim_requests(workload, rate, 80, MAX_MODEL_LEN, seed=seed) for seed in range(5)]
            return [replace(r, arrival_s=r.arrival_s + 1000.0 * seed) for seed, run in enumerate(runs) for r in run]

        table[workload] = {"slo_s": slo} | {
            system: {
                "measured": systems[system]["goodput"]["rate"],
                "bound": systems[system]["goodput"]["bound"],
                "simulated": goodput(system_spec(system, calibration), make, slo["ttft"], slo["tpot"], rel_tol=0.02),
            }
            for system in ("colocated", "colocated-chunked", "disagg-pull")
        }
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.planner_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="chatbot")
    parser.add_argument("--systems", default="colocated,disagg-pull")
    parser.add_argument("--fractions", default="0.3,0.6,0.9", help="shares of each system's measured goodput")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--out", default=str(DOC))
    parser.add_argument("--predict-only", action="store_true", help="rewrite the report from --out's planner.json")
    parser.add_argument(
        "--file-stack", action="store_true", help="do not probe the serving stack before the runs (the calibration's)"
    )
    options = parser.parse_args(argv)
    from bench.planner_report import write_report

    out = Path(options.out)
    calibration = Path(options.calibration)
    if options.predict_only:
        report = json.loads((out / "planner.json").read_text())
    else:
        report = measure(options, calibration)
    report = add_predictions(report, calibration)
    report["simulator_speed"] = simulator_speed(calibration)
    report["goodput_ordering"] = simulated_goodputs(calibration)
    write_report(report, out)


def measure(options: argparse.Namespace, calibration: Path) -> dict:
    from bench.host import machine

    goodput = json.loads(GOODPUT.read_text())["results"][options.workload]
    fractions = [float(f) for f in options.fractions.split(",")]
    Path(options.out).mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = {
        "command": "python -m bench.planner_check" + "".join(f" {a}" for a in (options and sys.argv[1:])),
        "machine": machine(),
        "workload": options.workload,
        "num_requests": options.num_requests,
        "seed": options.seed,
        "fractions": fractions,
        "systems": {},
    }
    for system in options.systems.split(","):
        measured = goodput[system]["goodput"]["rate"]
        rates = [round(f * measured, 4) for f in fractions]
        report["systems"][system] = {"goodput": measured, **measure_system(system, options.workload, rates, options)}
        report["elapsed_s"] = time.time() - started
        Path(options.out, "planner.json").write_text(json.dumps(report, indent=1))  # kept after each system
    return report


def add_predictions(report: dict, calibration: Path) -> dict:
    """Each point's prediction and comparison: from the calibration's engine fits with the
    serving stack probed on the app before its runs (when probed), and, as ``predicted_file``
    / ``rows_file``, with the calibration file's own stack."""
    for system, data in report["systems"].items():
        specs = {"": system_spec(system, calibration, data.get("stack"))}
        if data.get("stack"):
            specs["_file"] = system_spec(system, calibration)
        for point in data["points"]:
            for suffix, spec in specs.items():
                predicted = predict(spec, report["workload"], point["rate"], report["num_requests"], report["seed"])
                point["predicted" + suffix] = predicted
                point["rows" + suffix] = compare_point(point["runs"], predicted)
    report["calibration"] = os.path.relpath(calibration)
    return report


if __name__ == "__main__":
    main()
