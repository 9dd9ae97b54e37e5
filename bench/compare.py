"""Goodput of disaggregated against colocated serving: ``python -m bench.compare``.

On one machine, one after another, with the same total cores (2 engine replicas, one torch
thread each), each system is a Serve application in a fresh local Ray cluster
(``bench.ray_local.Server``) and runs the same rate sweep of each workload:

* ``colocated``          2 replicas doing both phases, plain continuous batching;
* ``colocated-chunked``  the same with chunked prefill (token budget 256 per step);
* ``disagg-pull``        1 prefill + 1 decode replica, decode pulls the KV over NIXL;
* ``disagg-push``        the same, prefill pushes each layer's KV as it is computed;
* ``elastic``            1 + 1 pull with the elastic autoscaler on (the default policy, its
                         SLOs set to the workload's: one server per workload).

Three stages: calibrate on the idle colocated system (``calibrate``: Splitwise's method, the
SLOs TTFT <= 5x and TPOT <= 2x the uncontended latency of the workload's median request, the
rates multiples of 2 / its uncontended E2E), run each system (``run_system``), render
(``write_report``, after every sweep, so an interrupted run still leaves a report; ``--merge``
reads the last one back). Writes ``goodput.{md,json,png}`` and ``goodput_cdf_<workload>.png``
(only the block between the markers of the ``.md`` is regenerated); every request's record
goes to ``--raw`` (``goodput_full.json``, not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.host import machine
from bench.ray_local import Server
from bench.report import (
    command_line,
    first_paragraph,
    plot_attainment,
    plot_cdfs,
    read_json,
    table,
    template,
    write_json,
    write_page,
)
from bench.serve import Target, run, sweep, uncontended
from bench.slo import SLO
from workloads import BenchRequest, make_requests, median_request

NAME = "bench.compare"
TTFT_SLO_X, TPOT_SLO_X = 5.0, 2.0  # SLOs as multiples of the uncontended latency
MAX_MODEL_LEN = 512
COMMON = {
    "model.max_model_len": str(MAX_MODEL_LEN),
    "engine.kv_cache_bytes": str(384 << 20),
    "prefill.torch_threads": "1",
    "decode.torch_threads": "1",
    "colocated.torch_threads": "1",
    "colocated.num_replicas": "2",
}
SYSTEMS = {  # name -> (application, its arguments)
    "colocated": ("colocated", {}),
    "colocated-chunked": (
        "colocated",
        {"engine.enable_chunked_prefill": "true", "engine.max_num_batched_tokens": "256"},
    ),
    "disagg-pull": ("disagg", {"transport.mode": "pull", "autoscaling.enabled": "false"}),
    "disagg-push": ("disagg", {"transport.mode": "push", "autoscaling.enabled": "false"}),
    "elastic": (
        "disagg",
        {"transport.mode": "pull", "autoscaling.enabled": "true", "autoscaling.replica_scaling": "false"},
    ),
}
SLO_AWARE = frozenset({"elastic"})  # started per workload, with that workload's SLOs
# rate points, as multiples of 2 / (uncontended E2E of the median request)
MULTIPLIERS = {
    "summarization": (0.25, 0.5, 0.75, 1.0, 1.25),
    "code": (0.5, 0.75, 1.0, 1.5),
    "chatbot": (0.5, 0.75, 1.0, 1.5),
}
DOC = Path("docs/benchmarks")

# ---- what the stages hand on -----------------------------------------------------------


@dataclass(frozen=True)
class WorkloadCalibration:
    """One workload on the idle colocated system, one request at a time, and what is fixed
    from it: the SLO and the rates of its sweeps."""

    prompt_tokens: int  # of the workload's median request
    ttft_s: float
    tpot_s: float
    median_output_tokens: float
    e2e_s: float  # ttft_s + (median_output_tokens - 1) * tpot_s
    multipliers: tuple[float, ...]
    rates: tuple[float, ...]  # req/s: each multiplier x 2 / e2e_s (two replicas)
    slo: SLO

    def to_json(self) -> dict:
        """The ``calibration`` entry of goodput.json (the SLO goes to ``slo_s``)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "slo"}

    @classmethod
    def from_json(cls, row: dict, slo_s: dict) -> WorkloadCalibration:
        """Inverse of ``to_json``, with the workload's ``slo_s`` entry."""
        tuples = {k: tuple(row[k]) for k in ("multipliers", "rates")}
        return cls(**{**row, **tuples, "slo": SLO(slo_s["ttft"], slo_s["tpot"])})


@dataclass(frozen=True)
class CrossCheck:
    """One request timed by this harness and, separately, around the official ``openai``
    client's streaming call."""

    prompt_tokens: int
    max_tokens: int
    harness_ttft_s: float
    openai_ttft_s: float
    harness_e2e_s: float
    openai_e2e_s: float


@dataclass(frozen=True)
class Calibration:
    """The calibrate stage's result: every workload's calibration, in report order."""

    workloads: dict[str, WorkloadCalibration]
    crosscheck: tuple[CrossCheck, ...]


@dataclass(frozen=True)
class SystemRun:
    """The run stage's result for one system: its sweep of each workload so far, as
    ``bench.serve.sweep`` returns it (``points`` and ``goodput``)."""

    system: str
    sweeps: dict[str, dict]


@dataclass(frozen=True)
class Report:
    """The render stage's input: everything the report files are made from."""

    command: str
    elapsed_s: float
    model: str | None
    calibration: Calibration
    results: dict[str, dict[str, dict]]  # workload -> system -> sweep, in report order


# ---- the independent check ---------------------------------------------------------------


def crosscheck(target: Target, requests: list[BenchRequest], num: int = 4) -> tuple[CrossCheck, ...]:
    """The same requests, one at a time, through this harness and through the official
    ``openai`` client (timed around its streaming call)."""
    from openai import OpenAI

    client = OpenAI(base_url=target.url + "/v1", api_key="unused", timeout=300)
    rows = []
    for request in requests[:num]:
        record = asyncio.run(run(target, [request], [0.0], progress=False))[0][0]
        start, first = time.perf_counter(), None
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0, "stream": True}
        for chunk in client.completions.create(model=target.model, **body, extra_body={"ignore_eos": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
        end = time.perf_counter()
        check = (record.ttft, first - start, record.e2e, end - start)
        rows.append(CrossCheck(request.prompt_tokens, request.max_tokens, *check))
    return tuple(rows)


# ---- the command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=NAME, description=first_paragraph(__doc__))
    parser.add_argument("--workloads", default="summarization,code,chatbot")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--num-requests", type=int, default=40, help="requests per rate point (>= 40 for reports)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--multipliers",
        default="",
        help="rate points per workload, e.g. 'code=0.5,1,1.5,2 chatbot=0.5,1' (default: MULTIPLIERS)",
    )
    parser.add_argument("--out", default=str(DOC), help="folder for goodput.md/json/png")
    parser.add_argument("--raw", default="bench-results", help="folder for per-request records (not committed)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other workloads of the previous report in --out (and its records in --raw)",
    )
    return parser


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: ``workloads`` and ``systems`` tuples, ``multipliers`` per workload,
    ``out`` and ``raw`` paths. Exits naming an unknown workload or system."""
    options = _parser().parse_args(argv)
    multipliers = dict(MULTIPLIERS)
    for item in options.multipliers.replace(";", " ").split():
        name, _, values = item.partition("=")
        multipliers[name] = tuple(float(v) for v in values.split(","))
    options.multipliers, options.out, options.raw = multipliers, Path(options.out), Path(options.raw)
    options.workloads = tuple(w for w in options.workloads.split(",") if w)
    options.systems = tuple(s for s in options.systems.split(",") if s)
    for kind, names, known in (("workload", options.workloads, MULTIPLIERS), ("system", options.systems, SYSTEMS)):
        for name in names:
            if name not in known:
                sys.exit(f"unknown {kind} {name!r}: choose from {', '.join(known)}")
    return options


def workload_requests(options: argparse.Namespace) -> dict[str, list[BenchRequest]]:
    """The same requests for every system: per workload, in the order given."""
    from bench.host import tokenizer

    words = tokenizer()
    return {w: make_requests(w, words, MAX_MODEL_LEN, options.num_requests, options.seed) for w in options.workloads}


# ---- stage 1: calibrate ----------------------------------------------------------------------


def calibrate(
    target: Target,
    requests: dict[str, list[BenchRequest]],
    multipliers: dict[str, tuple[float, ...]],
    checks: tuple[CrossCheck, ...] = (),
) -> Calibration:
    """Each workload's uncontended latency on ``target`` (the idle colocated system), and the
    harness cross-check unless ``checks`` (a merged report's) are given."""
    workloads = {w: calibrate_workload(target, w, r, multipliers[w]) for w, r in requests.items()}
    return Calibration(workloads=workloads, crosscheck=checks or crosscheck(target, next(iter(requests.values()))))


def calibrate_workload(
    target: Target, workload: str, requests: list[BenchRequest], multipliers: tuple[float, ...]
) -> WorkloadCalibration:
    """The median request, one at a time: its TTFT and TPOT fix the SLO, and the median
    request's E2E the rates (each multiplier x 2 / E2E: two replicas serving one each)."""
    base = uncontended(target, median_request(requests), max_tokens=32)
    outputs = statistics.median(r.max_tokens for r in requests)
    e2e = base["ttft_s"] + (outputs - 1) * base["tpot_s"]
    calibration = WorkloadCalibration(
        prompt_tokens=base["prompt_tokens"],
        ttft_s=base["ttft_s"],
        tpot_s=base["tpot_s"],
        median_output_tokens=outputs,
        e2e_s=e2e,
        multipliers=tuple(multipliers),
        rates=tuple(round(m * 2 / e2e, 4) for m in multipliers),
        slo=SLO(TTFT_SLO_X * base["ttft_s"], TPOT_SLO_X * base["tpot_s"]),
    )
    print(f"{workload}: uncontended {base}, SLO {calibration.slo}, rates {list(calibration.rates)}", file=sys.stderr)
    return calibration


# ---- stage 2: run one system ---------------------------------------------------------------


def run_system(
    target: Target,
    system: str,
    requests: dict[str, list[BenchRequest]],
    calibration: Calibration,
    seed: int,
    metrics_url: str | None,
) -> Iterator[SystemRun]:
    """Sweep each workload's rates on ``target``; yields the run so far after each sweep."""
    sweeps: dict[str, dict] = {}
    for workload, batch in requests.items():
        label, fixed = f"{system}/{workload}", calibration.workloads[workload]
        sweeps[workload] = sweep(
            target, batch, list(fixed.rates), fixed.slo, seed=seed, metrics_url=metrics_url, label=label
        )
        print(f"{label}: goodput {sweeps[workload]['goodput']['text']} req/s", file=sys.stderr)
        yield SystemRun(system=system, sweeps=dict(sweeps))


# ---- stage 3: the report, rewritten after every sweep --------------------------------------


@dataclass(frozen=True)
class ReportBasis:
    """What every rewrite of this run's report shares: the command, the start, the workloads
    (in order) and, with --merge, the previous report (its other workloads come first)."""

    command: str
    started: float  # time.time()
    workloads: tuple[str, ...]
    previous: Report | None = None

    def report(self, calibration: Calibration, runs: list[SystemRun], model: str) -> Report:
        """The report of the previous workloads and of ``runs`` so far."""
        this_run = {w: {r.system: r.sweeps[w] for r in runs if w in r.sweeps} for w in self.workloads}
        elapsed_s = time.time() - self.started
        if self.previous is None:
            return Report(self.command, elapsed_s, model, calibration, this_run)
        previous = self.previous
        workloads = {**previous.calibration.workloads, **calibration.workloads}
        return Report(
            command=f"{previous.command} && {self.command}",
            elapsed_s=previous.elapsed_s + elapsed_s,
            model=model,
            calibration=Calibration(workloads=workloads, crosscheck=calibration.crosscheck),
            results={**previous.results, **this_run},
        )


def load_previous(out: Path, raw: Path, skip: list[str]) -> Report:
    """The last report, without the workloads in ``skip`` (those this run repeats) and
    those it had no sweep of."""
    summary, full = read_json(out / "goodput.json"), read_json(raw / "goodput_full.json")
    kept = [w for w in full if w not in skip and full[w]]
    workloads = {w: WorkloadCalibration.from_json(summary["calibration"][w], summary["slo_s"][w]) for w in kept}
    checks = tuple(CrossCheck(**row) for row in summary.get("crosscheck", []))
    return Report(
        command=summary["command"],
        elapsed_s=summary["elapsed_s"],
        model=summary.get("model"),
        calibration=Calibration(workloads=workloads, crosscheck=checks),
        results={w: full[w] for w in kept},
    )


def write_report(report: Report, out: Path, raw: Path) -> None:
    """goodput.json, goodput.md and the PNGs in ``out``; every request's record in ``raw``."""
    write_json(raw / "goodput_full.json", report.results, indent=None)
    out.mkdir(parents=True, exist_ok=True)
    plot_attainment(report.results, out / "goodput.png")
    summary = summary_json(report, machine())
    write_json(out / "goodput.json", summary)
    for workload, systems in report.results.items():
        if systems:
            points = {s: _middle_point(sweep) for s, sweep in systems.items()}
            plot_cdfs(points, out / f"goodput_cdf_{workload}.png", workload)
    new = template(NAME, "# Goodput: disaggregated against colocated")
    write_page(out / "goodput.md", NAME, render(summary), new)


def summary_json(report: Report, host: str) -> dict:
    """goodput.json: the report without the per-request records."""
    workloads = report.calibration.workloads
    results = {
        w: {
            s: {"goodput": sweep["goodput"], "points": [_without_records(p) for p in sweep["points"]]}
            for s, sweep in systems.items()
        }
        for w, systems in report.results.items()
    }
    return {
        "command": report.command,
        "machine": host,
        "model": report.model,
        "elapsed_s": report.elapsed_s,
        "slo_multiples": {"ttft": TTFT_SLO_X, "tpot": TPOT_SLO_X},
        "calibration": {w: c.to_json() for w, c in workloads.items()},
        "slo_s": {w: {"ttft": c.slo.ttft_s, "tpot": c.slo.tpot_s} for w, c in workloads.items()},
        "crosscheck": [asdict(c) for c in report.calibration.crosscheck],
        "results": results,
    }


def _without_records(point: dict) -> dict:
    return {k: v for k, v in point.items() if k != "records"}


def _middle_point(sweep: dict) -> dict:
    return sweep["points"][len(sweep["points"]) // 2]


def render(summary: dict) -> list[str]:
    """The generated block of goodput.md, from goodput.json: the SLOs, per workload a row per
    system (its figures at the middle rate of its sweep), the harness cross-check."""
    head = f"Command: `{summary['command']}` ({summary['elapsed_s'] / 60:.0f} min). Machine: {summary['machine']}."
    lines = ["", head, "", "SLOs (TTFT 5x, TPOT 2x the uncontended latency on the idle colocated system):", ""]
    slos = []
    for w, c in summary["calibration"].items():
        slo, rates = summary["slo_s"][w], ", ".join(f"{r:.3g}" for r in c["rates"])
        uncontended_s = [f"{c['ttft_s']:.3f} s ({c['prompt_tokens']} tok)", f"{c['tpot_s'] * 1e3:.0f} ms"]
        slos.append([w, *uncontended_s, f"{slo['ttft']:.3f} s", f"{slo['tpot'] * 1e3:.0f} ms", rates])
    header = ["workload", "uncontended TTFT", "uncontended TPOT", "TTFT SLO", "TPOT SLO", "rates (req/s)"]
    lines += [*table(header, slos), "", "![attainment against rate](goodput.png)", ""]
    header = ["system", "goodput (req/s)", "vs colocated", "attainment per rate", "TTFT p90 (s)", "TPOT p90 (ms)"]
    for workload, systems in summary["results"].items():
        if systems:
            rows = [_system_row(s, sweep, systems.get("colocated")) for s, sweep in systems.items()]
            lines += [f"### {workload}", "", *table([*header, "server TTFT split, mean (s)"], rows), ""]
            lines += [f"![TTFT and TPOT CDFs, {workload}](goodput_cdf_{workload}.png)", ""]
    if summary["crosscheck"]:
        lines += ["Harness against the official `openai` client (same requests, one at a time):", ""]
        header = ["prompt", "output", "TTFT harness", "TTFT openai", "E2E harness", "E2E openai"]
        times = ("harness_ttft_s", "openai_ttft_s", "harness_e2e_s", "openai_e2e_s")
        rows = [[c["prompt_tokens"], c["max_tokens"], *(f"{c[k]:.3f}" for k in times)] for c in summary["crosscheck"]]
        lines += [*table(header, rows), ""]
    return lines


def _system_row(system: str, sweep: dict, colocated: dict | None) -> list:
    mid = _middle_point(sweep)
    attained = " / ".join(f"{p['attainment']:.0%}" for p in sweep["points"])
    split = ", ".join(f"{k} {v:.3f}" for k, v in mid["server_ttft_split_s"].items())
    figures = [f"{mid['ttft_s']['p90']:.2f}", f"{mid['tpot_s']['p90'] * 1e3:.0f}", f"{split} (at {mid['rate']:.3g}/s)"]
    return [system, sweep["goodput"]["text"], ratio_text(sweep, colocated), attained, *figures]


def ratio_text(sweep: dict, reference: dict | None) -> str:
    """Goodput ratio to the reference, with the direction of any bound (a sweep can end
    above every rate tried, or fail already at the lowest)."""
    if reference is None:
        return "n/a"
    mine, ref = sweep["goodput"], reference["goodput"]
    lowest = min(p["rate"] for p in reference["points"])
    if ref["bound"] == "below":  # reference goodput < its lowest rate
        if mine["bound"] == "below":
            return "n/a (both below the lowest rate)"
        return f"> {mine['rate'] / lowest:.2f}x"
    value = mine["rate"] / ref["rate"]
    if mine["bound"] == "at_least" and ref["bound"] != "at_least":
        return f">= {value:.2f}x"
    if ref["bound"] == "at_least" and mine["bound"] != "at_least":
        return f"<= {value:.2f}x"
    if mine["bound"] == "below":
        return f"< {lowest / ref['rate']:.2f}x"
    return f"{value:.2f}x" + (" (both above the highest rate)" if mine["bound"] == "at_least" else "")


# ---- the comparison ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    requests = workload_requests(options)
    previous = load_previous(options.out, options.raw, list(options.workloads)) if options.merge else None
    basis = ReportBasis(command_line(NAME, argv), time.time(), options.workloads, previous)
    calibration: Calibration | None = None
    runs: list[SystemRun] = []
    # calibrate on the plain colocated system, then run every system
    order = ["colocated"] + [s for s in options.systems if s != "colocated"]
    for index, (system, batch) in enumerate(_servers(order, requests)):
        application, extra = SYSTEMS[system]
        slo_args = _slo_args(calibration, batch) if system in SLO_AWARE else {}
        with Server(application, {**COMMON, **extra, **slo_args}, index) as server:
            target = Target(server.url, server.model())
            if calibration is None:
                checks = previous.calibration.crosscheck if previous else ()
                calibration = calibrate(target, requests, options.multipliers, checks)
            if system not in options.systems:
                continue
            done = next((r for r in runs if r.system == system), SystemRun(system=system, sweeps={}))
            runs = [r for r in runs if r is not done]
            run = done
            for run in run_system(target, system, batch, calibration, options.seed, server.metrics_url):
                run = SystemRun(system=system, sweeps={**done.sweeps, **run.sweeps})
                write_report(basis.report(calibration, [*runs, run], target.model), options.out, options.raw)
            runs.append(run)


def _servers(order: list[str], requests: dict[str, list[BenchRequest]]) -> Iterator[tuple[str, dict]]:
    """(system, the workloads its server runs): SLO-aware systems get a server per workload."""
    for system in order:
        if system in SLO_AWARE:
            yield from ((system, {w: r}) for w, r in requests.items())
        else:
            yield system, requests


def _slo_args(calibration: Calibration | None, batch: dict[str, list[BenchRequest]]) -> dict[str, str]:
    """The app's ``slo`` section from the calibration of the server's one workload."""
    (workload,) = batch
    slo = calibration.workloads[workload].slo
    return {"slo.ttft_ms": f"{slo.ttft_s * 1e3:.1f}", "slo.tpot_ms": f"{slo.tpot_s * 1e3:.1f}"}


if __name__ == "__main__":
    main()
