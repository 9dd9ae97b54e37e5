"""The simulator against the served app: ``python -m bench.planner_check`` (docs/benchmarks/planner.md).

Each of ``bench.compare``'s systems checked serves one workload at shares of its goodput in
docs/benchmarks/goodput.json, twice per rate with the same requests and arrivals; the simulator,
calibrated on this machine (``bench.calibrate_planner``) with the serving stack probed on the app
just before its runs, predicts TTFT and TPOT p50 / p90 for the same lengths and arrivals."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from bench.calibrate_planner import NO_PREFIX_CACHE, probe_stack
from bench.compare import MAX_MODEL_LEN, system_server
from bench.host import machine, timed, tokenizer
from bench.report import arguments, command_line, figure, publish, read_json, table, write_json
from bench.serve import Target, run, uncontended
from bench.slo import summarize
from planner.costs import DEFAULT_CALIBRATION, ServingStack, load_calibration
from planner.simulator import SystemSpec, goodput, sim_requests, simulate, uncontended_latency
from workloads import arrival_times, make_requests, median_request

NAME = "bench.planner_check"
DOC = Path("docs/benchmarks")
GOODPUT = DOC / "goodput.json"
ROOT = Path(__file__).resolve().parents[1]
METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))
MIN_BOUND = 0.15
TWINS = {  # bench.compare's systems the simulator has a twin of: the twin's changes from colocated
    "colocated": {},
    "colocated-chunked": {"chunked_prefill": True, "max_num_batched_tokens": 256},
    "disagg-pull": {"kind": "disaggregated", "prefill_replicas": 1, "decode_replicas": 1},
}


def system_spec(system: str, calibration: Path, stack: dict | None = None) -> SystemSpec:
    """The simulated twin of a ``bench.compare`` system, with the file's serving stack of its kind or ``stack``."""
    if system not in TWINS:
        raise SystemExit(f"no simulated twin of {system!r} ({', '.join(TWINS)})")
    cost = load_calibration(calibration)
    spec = replace(SystemSpec("colocated", 2, 0, cost, cost, interference=cost.interference), **TWINS[system])
    return replace(spec, stack=ServingStack.of(stack) if stack else cost.stack(spec.kind))


def measure(options: argparse.Namespace) -> dict:
    """Per system in one server: idle latency, the stack probed, ``--runs`` runs per goodput share."""
    goodputs, started = read_json(GOODPUT)["results"][options.workload], time.time()
    fractions, cost = [float(f) for f in options.fractions.split(",")], load_calibration(options.calibration)
    requests = make_requests(options.workload, tokenizer(), MAX_MODEL_LEN, options.num_requests, options.seed)
    report = {"command": command_line(NAME), "machine": machine(), "workload": options.workload,
              "num_requests": options.num_requests, "seed": options.seed, "fractions": fractions,
              "systems": {}}  # fmt: skip
    for system in options.systems.split(","):
        kind, measured = system_spec(system, options.calibration).kind, goodputs[system]["goodput"]["rate"]
        with system_server(system, 0, NO_PREFIX_CACHE) as server:
            target = Target(server.url, server.model())
            idle = uncontended(target, median_request(requests))  # also warms the replicas up
            print(f"{system}: uncontended {idle}", file=sys.stderr)
            probed = {} if options.file_stack else {"stack": probe_stack(target, cost, kind)}
            points = []
            for rate in (round(f * measured, 4) for f in fractions):
                runs, offsets = [], arrival_times(len(requests), rate, seed=options.seed)
                for label in (f"{system} {rate:.3g}/s #{n + 1}" for n in range(options.runs)):
                    summary = summarize(*asyncio.run(run(target, requests, offsets, label)))
                    short = ", ".join(f"{m} {p} {summary[m][p]:.3f}" for m, p in METRICS)
                    print(f"  {label}: {short}, failed {summary['failed']}", file=sys.stderr)
                    runs.append({m: summary[m] for m in ("ttft_s", "tpot_s", "failed", "duration_s")})
                points.append({"rate": rate, "runs": runs})
        report["systems"][system] = {"goodput": measured, "uncontended": idle, **probed, "points": points}
        report["elapsed_s"] = time.time() - started
        write_json(Path(options.out, "planner.json"), report)
    return report


def compare_point(runs: list[dict], predicted: dict) -> list[dict]:
    """One row per metric: both runs, spread, prediction, error, bound, within."""
    rows = []
    for metric, pct in METRICS:
        values = [r[metric][pct] for r in runs]
        mean = sum(values) / len(values)
        spread = (max(values) - min(values)) / mean if mean else 0.0
        bound, guess = max(MIN_BOUND, 2 * spread), predicted[metric][pct]
        error = (guess - mean) / mean if mean else float("inf")
        rows.append({"metric": f"{metric.removesuffix('_s')} {pct}", "measured": values, "mean": mean, "spread": spread,
                     "predicted": guess, "error": error, "bound": bound, "within": abs(error) <= bound})  # fmt: skip
    return rows


def simulator_speed(calibration: Path) -> dict:
    """Seconds for simulate() on 1,000 replicas of this machine's cost (400 prefill + 600 decode), chatbot traffic."""
    cost, requests = load_calibration(calibration), sim_requests("chatbot", 250.0, 20_000, MAX_MODEL_LEN, seed=0)
    result, seconds = timed(lambda: simulate(SystemSpec("disaggregated", 400, 600, cost, cost), requests))
    return {"replicas": 1000, "requests": len(requests), "rate": 250.0,
            "output_tokens": sum(r.output_tokens for r in requests), "seconds": seconds,
            "ttft_p90_s": result.percentiles()["ttft_s"]["p90"]}  # fmt: skip


def _five_runs(workload: str, rate: float) -> list:
    runs = [sim_requests(workload, rate, 80, MAX_MODEL_LEN, seed=seed) for seed in range(5)]
    return [replace(r, arrival_s=r.arrival_s + 1000.0 * seed) for seed, run in enumerate(runs) for r in run]


def simulated_goodputs(calibration: Path) -> dict:
    """Per workload, measured and simulated goodput on SLOs from the calibration's own speed (it drifts)."""
    measured, found = read_json(GOODPUT), {}
    for workload, systems in measured["results"].items():
        median, x = measured["calibration"][workload]["prompt_tokens"], measured["slo_multiples"]
        ttft, tpot = uncontended_latency(system_spec("colocated", calibration), median)
        slo = {"ttft": x["ttft"] * ttft, "tpot": x["tpot"] * tpot}
        found[workload] = {"slo_s": slo}
        for system in TWINS:
            spec, known = system_spec(system, calibration), systems[system]["goodput"]
            simulated = goodput(spec, partial(_five_runs, workload), slo["ttft"], slo["tpot"], rel_tol=0.02)
            found[workload][system] = {"measured": known["rate"], "bound": known["bound"], "simulated": simulated}
    return found


def add_predictions(report: dict, calibration: Path) -> dict:
    """Each point's prediction with the probed stack and (``*_file``) with the file's stack."""
    workload, num_requests, seed = report["workload"], report["num_requests"], report["seed"]
    for system, data in report["systems"].items():
        specs = {"": system_spec(system, calibration, data.get("stack"))}
        if data.get("stack"):
            specs["_file"] = system_spec(system, calibration)
        for point in data["points"]:
            for suffix, spec in specs.items():
                arrivals = sim_requests(workload, point["rate"], num_requests, MAX_MODEL_LEN, seed)
                percentiles = simulate(spec, arrivals).percentiles()
                point["predicted" + suffix] = predicted = {m: percentiles[m] for m in ("ttft_s", "tpot_s")}
                point["rows" + suffix] = compare_point(point["runs"], predicted)
    report["calibration"] = os.path.relpath(calibration)
    return report


def _count(report: dict, key: str = "rows") -> tuple[int, int]:
    rows = [r for s in report["systems"].values() for p in s["points"] for r in p.get(key, [])]
    return sum(r["within"] for r in rows), len(rows)


def render(r: dict) -> list[str]:
    (within, total), (file_within, file_total) = _count(r), _count(r, "rows_file")
    runs = len(next(iter(r["systems"].values()))["points"][0]["runs"])  # per rate, as --runs asked
    times, the_runs = ("twice", "the two runs") if runs == 2 else (f"{runs} times", f"the {runs} runs")
    headline = f"**{within} of {total} predictions within their bound**" + (
        f" with the serving stack probed on each app just before its runs; {file_within} of {file_total} with the"
        " calibration file's stack" if file_total else "")  # fmt: skip
    lines = [
        "", f"Command: `{r['command']}` ({r.get('elapsed_s', 0) / 60:.0f} min). Machine: {r['machine']}.",
        f"Workload `{r['workload']}` ({r['num_requests']} requests a run, seed {r['seed']}, context 512);",
        f"each rate run {times} with the same requests and arrivals. Predictions: `planner.simulator.simulate` on",
        f"`{r['calibration']}` (no measurement of this check feeds it), same lengths and arrivals.",
        f"Error = (predicted - mean of {the_runs}) / that mean; bound = max(15%, 2 x spread of the runs).",
        "", headline + ".", "", *_calibration_lines(ROOT / r["calibration"]),
    ]  # fmt: skip
    for system, data in r["systems"].items():
        lines += _system_lines(system, data, r["fractions"])
    if speed := r.get("simulator_speed"):
        lines += ["", f"Simulator speed: `simulate()` on {speed['replicas']} replicas (400 prefill + 600 decode, this",
                  f"machine's costs), {speed['requests']:,} chatbot requests at {speed['rate']:g} req/s "
                  f"({speed['output_tokens']:,} output tokens): {speed['seconds']:.2f} s, pure Python."]  # fmt: skip
    return [*lines, *_ordering_lines(r.get("goodput_ordering")), "", "![predicted against measured](planner.png)", ""]


def _system_lines(system: str, data: dict, fractions: list[float]) -> list[str]:
    """One system's section: idle latency, probed stack, a row per point and metric, measured / predicted."""
    lines = ["", f"### {system} (measured goodput {data['goodput']:.3g} req/s)", ""]
    if idle := data.get("uncontended"):
        lines += [f"Uncontended (median prompt, {idle['prompt_tokens']} tokens, one at a time): TTFT "
                  f"{idle['ttft_s']:.3f} s, TPOT {idle['tpot_s'] * 1e3:.1f} ms.", ""]  # fmt: skip
    if data.get("stack"):
        lines += [f"Serving stack probed on this app before its runs: {_stack_cell(data['stack'])}.", ""]
    rows, ratios = [], {}
    for point, share in zip(data["points"], fractions):
        for row in point["rows"]:
            scale, unit = (1e3, "ms") if row["metric"].startswith("tpot") else (1.0, "s")
            runs = [f"{v * scale:.3g} {unit}" for v in row["measured"]]
            rows.append([f"{point['rate']:.3g} ({share:.0%})", row["metric"], *runs, f"{row['spread']:.0%}"]
                        + [f"{row['predicted'] * scale:.3g} {unit}", f"{row['error']:+.0%}", f"{row['bound']:.0%}"]
                        + ["yes" if row["within"] else "no"])  # fmt: skip
            ratios.setdefault(row["metric"], []).append(row["mean"] / row["predicted"])
    run_columns = " | ".join(f"run {n + 1}" for n in range(len(data["points"][0]["runs"])))
    header = f"rate (share of goodput) | metric | {run_columns} | spread | predicted | error | bound | within"
    cells_ = ", ".join(f"{metric} {statistics.median(values):.2f}x" for metric, values in ratios.items())
    return [*lines, *table(header, rows), "", f"Measured / predicted (median over the rates): {cells_}."]


def _ordering_lines(ordering: dict | None) -> list[str]:
    """The goodput table: measured (goodput.md) and simulated per workload and system."""
    rows = []
    for workload, systems in (ordering or {}).items():
        slo, colocated, pull = systems["slo_s"], systems["colocated"], systems["disagg-pull"]
        ratio = (f"{pull['measured'] / colocated['measured']:.2f}x, "
                 f"{pull['simulated'] / max(colocated['simulated'], 1e-12):.2f}x")  # fmt: skip
        for system, row in systems.items():
            if system != "slo_s":
                measured = ("&ge; " if row["bound"] == "at_least" else "") + f"{row['measured']:.3g}"
                rows.append(f"{workload} | {slo['ttft']:.3g} s, {slo['tpot'] * 1e3:.0f} ms | {system} | {measured}"
                            f" | {row['simulated']:.3g} | {ratio if system == 'disagg-pull' else ''}")  # fmt: skip
    header = "workload | simulated SLOs | system | measured | simulated | disagg-pull / colocated: measured, simulated"
    return ["", "Goodput (req/s), measured in goodput.md and simulated, each on SLOs of 5x TTFT and 2x TPOT",
            "of its own idle colocated system (measured there; simulated here, the workload's median prompt);",
            "5 x 80 requests a rate:", "", *table(header, rows)] if rows else []  # fmt: skip


def _calibration_lines(path: Path) -> list[str]:
    cost = load_calibration(path)
    raw, decode, transfer = cost.raw, cost.decode, cost.transfer
    prefill = ", ".join(f"{x:.0f} tok {y:.3f} s" for x, y in zip(cost.prefill.xs, cost.prefill.ys))
    rows = [
        ["prefill", f"piecewise-linear: {prefill}", len(raw["prefill"])],
        ["decode step", f"{decode.intercept * 1e3:.1f} ms + {decode.coefs[0] * 1e3:.2f} ms x batch + "
         f"{decode.coefs[1] * 1e6:.3f} us x KV tokens + {decode.coefs[2] * 1e3:.1f} ms if batch >= 2",
         len(raw["decode"])],
        ["KV pull (NIXL)", f"{transfer.intercept * 1e3:.2f} ms + bytes / {cost.transfer_bytes_per_s / 1e9:.2f} GB/s",
         len(raw["transfer"])],
        ["interference", f"{cost.interference:+.1%} on a step started while another replica computes", "1 floor run"],
    ]  # fmt: skip
    for kind, stack in sorted(cost.stacks.items()):
        probes = len(raw["stack"]["kinds"][kind].get("probes", []))
        batches = f", {len(stack.batched_decode_factors)} batches" if stack.batched_decode_factors else ""
        rows.append([f"serving stack, {kind}", _stack_cell(stack), f"{probes} idle-app probes{batches}, 1 load run"])
    head = f"Calibration (`{raw['command']}`, {raw['machine']}, {raw['created']}):"
    return [head, "", *table("part | fit | points", rows)]


def _stack_cell(stack: ServingStack | dict) -> str:
    stack = ServingStack.of(stack) if isinstance(stack, dict) else stack
    batched = "".join(f", x {f:.2f} at batch {b}" for b, f in stack.batched_decode_factors)
    return (f"TTFT + {stack.ttft_s * 1e3:.0f} ms; prefill x {stack.prefill_factor:.2f}, decode x "
            f"{stack.decode_factor:.2f}{batched}; {stack.cpu_s_per_token * 1e3:.1f} ms CPU per streamed token on "
            f"{stack.cores} shared cores")  # fmt: skip


def write_report(report: dict, out: Path) -> None:
    publish(out, "planner", NAME, report, render(report), "# Planner: the simulator against the served app")
    with figure(out / "planner.png", 1, 4, (14, 3.6), dpi=90) as (*axes, _):
        for ax, (metric, pct) in zip(axes, METRICS):
            name = f"{metric.removesuffix('_s')} {pct}"
            for system, data in report["systems"].items():
                rates = [p["rate"] for p in data["points"]]
                rows = [next(r for r in p["rows"] if r["metric"] == name) for p in data["points"]]
                (line,) = ax.plot(rates, [r["mean"] for r in rows], marker="o", label=f"{system} measured")
                colour = line.get_color()
                ax.vlines(rates, [min(r["measured"]) for r in rows], [max(r["measured"]) for r in rows], color=colour)
                ax.plot(rates, [r["predicted"] for r in rows], "x--", color=colour, label=f"{system} predicted")
            ax.set(title=f"{name.upper()} (s)", xlabel="rate (req/s)")
        axes[0].legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    parser = arguments(NAME, __doc__, DOC, "folder for planner.md/json/png")
    parser.add_argument("--workload", default="chatbot")
    parser.add_argument("--systems", default="colocated,disagg-pull")
    parser.add_argument("--fractions", default="0.3,0.6,0.9", help="shares of each system's measured goodput")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION)
    parser.add_argument("--predict-only", action="store_true", help="rewrite the report from --out's planner.json")
    parser.add_argument("--file-stack", action="store_true", help="skip the stack probe (the calibration file's stack)")
    options = parser.parse_args(argv)
    report = read_json(options.out / "planner.json") if options.predict_only else measure(options)
    report = add_predictions(report, options.calibration)
    report["simulator_speed"] = simulator_speed(options.calibration)
    report["goodput_ordering"] = simulated_goodputs(options.calibration)
    write_report(report, options.out)


if __name__ == "__main__":
    main()
