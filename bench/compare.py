"""Goodput of disaggregated against colocated serving: ``python -m bench.compare``.

Each system (``SYSTEMS``, 2 engine replicas of one torch thread in all) runs the same rate sweep of each workload in a
fresh local Ray; SLOs (TTFT 5x, TPOT 2x, Splitwise's rule) and rates come from the idle colocated system. The report is
rewritten after every sweep (``--merge`` keeps the last one's other workloads)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from app.local_cluster import Server
from bench.host import machine, tokenizer
from bench.report import arguments, cells, command_line, publish, read_json, subset, table, write_json
from bench.serve import Target, run, sweep, uncontended
from bench.slo import SLO
from workloads import BenchRequest, make_requests, median_request

NAME = "bench.compare"
TTFT_SLO_X, TPOT_SLO_X = 5.0, 2.0  # SLOs as multiples of the uncontended latency
MAX_MODEL_LEN = 512
COMMON = {"model.max_model_len": str(MAX_MODEL_LEN), "engine.kv_cache_bytes": str(384 << 20),
          "prefill.torch_threads": "1", "decode.torch_threads": "1", "colocated.torch_threads": "1",
          "colocated.num_replicas": "2"}  # fmt: skip
CHUNKED = {"engine.enable_chunked_prefill": "true", "engine.max_num_batched_tokens": "256"}
FIXED = {"autoscaling.enabled": "false"}  # disaggregated with fixed pools
ELASTIC = {"transport.mode": "pull", "autoscaling.enabled": "true", "autoscaling.replica_scaling": "false"}
SYSTEMS = {  # name -> (application, its arguments)
    "colocated": ("colocated", {}),
    "colocated-chunked": ("colocated", CHUNKED),
    "disagg-pull": ("disagg", {"transport.mode": "pull", **FIXED}),
    "disagg-push": ("disagg", {"transport.mode": "push", **FIXED}),
    "elastic": ("disagg", ELASTIC),
}
SLO_AWARE = frozenset({"elastic"})  # started per workload, with that workload's SLOs
# rate points, as multiples of 2 / (uncontended E2E of the median request)
MULTIPLIERS = {"summarization": (0.25, 0.5, 0.75, 1.0, 1.25), "code": (0.5, 0.75, 1.0, 1.5),
               "chatbot": (0.5, 0.75, 1.0, 1.5)}  # fmt: skip


def system_server(system: str, index: int = 0, args: dict[str, str] | None = None) -> Server:
    """One of ``SYSTEMS`` on ``COMMON`` (and ``args``) in its own local Ray (``app.local_cluster.Server``)."""
    application, extra = SYSTEMS[system]
    return Server(application, {**COMMON, **extra, **(args or {})}, index)


def workload_slo(calibration: dict) -> SLO:
    """A workload's SLOs from its row of ``calibrate``: TTFT 5x, TPOT 2x its uncontended latency."""
    return SLO(TTFT_SLO_X * calibration["ttft_s"], TPOT_SLO_X * calibration["tpot_s"])


def crosscheck(target: Target, requests: list[BenchRequest], num: int = 4) -> list[dict]:
    """The same requests, one at a time, through this harness and through the ``openai`` client."""
    from openai import OpenAI

    client, rows = OpenAI(base_url=target.url + "/v1", api_key="unused", timeout=300), []
    for request in requests[:num]:
        record = asyncio.run(run(target, [request], [0.0], progress=False))[0][0]
        start, first = time.perf_counter(), None
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0, "stream": True}
        for chunk in client.completions.create(model=target.model, **body, extra_body={"ignore_eos": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
        end = time.perf_counter()
        rows.append({"prompt_tokens": request.prompt_tokens, "max_tokens": request.max_tokens,
                     "harness_ttft_s": record.ttft, "openai_ttft_s": first - start,
                     "harness_e2e_s": record.e2e, "openai_e2e_s": end - start})  # fmt: skip
    return rows


def _multipliers(text: str) -> dict[str, tuple[float, ...]]:
    """``MULTIPLIERS`` with the workloads given ('code=0.5,1 chatbot=1') replaced."""
    items = (item.partition("=") for item in text.replace(";", " ").split())
    return {**MULTIPLIERS, **{name: tuple(float(v) for v in values.split(",")) for name, _, values in items}}


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(NAME, __doc__, "docs/benchmarks", "folder for goodput.md/json/png")
    parser.add_argument("--workloads", **subset(MULTIPLIERS, "workload"))
    parser.add_argument("--systems", **subset(SYSTEMS))
    parser.add_argument("--num-requests", type=int, default=40, help="requests per rate point (>= 40 for reports)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--multipliers", type=_multipliers, default="", help="rate points, e.g. 'code=0.5,1 chatbot=1'")
    parser.add_argument("--raw", type=Path, default=Path("bench-results"), help="folder for per-request records")
    parser.add_argument("--merge", action="store_true", help="keep the other workloads of the report in --out")
    return parser.parse_args(argv)


def workload_requests(options: argparse.Namespace) -> dict[str, list[BenchRequest]]:
    words = tokenizer()
    return {w: make_requests(w, words, MAX_MODEL_LEN, options.num_requests, options.seed) for w in options.workloads}


def calibrate(target: Target, requests: dict[str, list[BenchRequest]], multipliers: dict) -> dict[str, dict]:
    """Per workload, its median request alone on idle colocated, and its rates: multipliers x 2 / E2E."""
    workloads = {}
    for workload, batch in requests.items():
        base = uncontended(target, median_request(batch), max_tokens=32)
        outputs = statistics.median(r.max_tokens for r in batch)
        e2e, ms = base["ttft_s"] + (outputs - 1) * base["tpot_s"], list(multipliers[workload])
        workloads[workload] = base | {"median_output_tokens": outputs, "e2e_s": e2e, "multipliers": ms,
                                      "rates": [round(m * 2 / e2e, 4) for m in ms]}  # fmt: skip
        print(f"{workload}: {workloads[workload]}, SLO {workload_slo(workloads[workload])}", file=sys.stderr)
    return workloads


def merged(report: dict, previous: dict | None) -> dict:
    """This run's report behind the previous one's other workloads (``--merge``)."""
    return report if previous is None else report | {
        "command": f"{previous['command']} && {report['command']}",
        "elapsed_s": previous["elapsed_s"] + report["elapsed_s"],
        "calibration": previous["calibration"] | report["calibration"],
        "results": previous["results"] | report["results"]}  # fmt: skip


def load_previous(out: Path, raw: Path, skip: list[str]) -> dict:
    """The last report, without the workloads in ``skip`` (this run repeats them) or no sweep."""
    summary, full = read_json(out / "goodput.json"), read_json(raw / "goodput_full.json")
    full = {w: sweeps for w, sweeps in full.items() if w not in skip and sweeps}
    return {"command": summary["command"], "elapsed_s": summary["elapsed_s"], "model": summary.get("model"),
            "calibration": {w: summary["calibration"][w] for w in full},
            "crosscheck": summary.get("crosscheck", []), "results": full}  # fmt: skip


def write_report(report: dict, out: Path, raw: Path) -> None:
    from bench.report import plot_attainment, plot_cdfs

    write_json(raw / "goodput_full.json", report["results"], indent=None)
    slos = {w: workload_slo(c) for w, c in report["calibration"].items()}
    results = {w: {s: without_records(sw) for s, sw in by.items()} for w, by in report["results"].items()}
    summary = {"command": report["command"], "machine": machine(), "model": report["model"],
               "elapsed_s": report["elapsed_s"], "slo_multiples": {"ttft": TTFT_SLO_X, "tpot": TPOT_SLO_X},
               "calibration": report["calibration"],
               "slo_s": {w: {"ttft": slo.ttft_s, "tpot": slo.tpot_s} for w, slo in slos.items()},
               "crosscheck": report["crosscheck"], "results": results}  # fmt: skip
    publish(out, "goodput", NAME, summary, render(summary), "# Goodput: disaggregated against colocated")
    plot_attainment(report["results"], out / "goodput.png")
    for workload, systems in report["results"].items():
        if systems:
            points = {s: _middle_point(sweep) for s, sweep in systems.items()}
            plot_cdfs(points, out / f"goodput_cdf_{workload}.png", workload)


def without_records(sweep: dict) -> dict:
    points = [{k: v for k, v in point.items() if k != "records"} for point in sweep["points"]]
    return {"goodput": sweep["goodput"], "points": points}


def _middle_point(sweep: dict) -> dict:
    return sweep["points"][len(sweep["points"]) // 2]


def render(summary: dict) -> list[str]:
    head = f"Command: `{summary['command']}` ({summary['elapsed_s'] / 60:.0f} min). Machine: {summary['machine']}."
    lines = ["", head, "", "SLOs (TTFT 5x, TPOT 2x the uncontended latency on the idle colocated system):", ""]
    slos = []
    for w, c in summary["calibration"].items():
        slo, rates = summary["slo_s"][w], ", ".join(f"{r:.3g}" for r in c["rates"])
        uncontended_s = [f"{c['ttft_s']:.3f} s ({c['prompt_tokens']} tok)", f"{c['tpot_s'] * 1e3:.0f} ms"]
        slos.append([w, *uncontended_s, f"{slo['ttft']:.3f} s", f"{slo['tpot'] * 1e3:.0f} ms", rates])
    header = "workload | uncontended TTFT | uncontended TPOT | TTFT SLO | TPOT SLO | rates (req/s)"
    lines += [*table(header, slos), "", "![attainment against rate](goodput.png)", ""]
    header = "system | goodput (req/s) | vs colocated | attainment per rate | TTFT p90 (s) | TPOT p90 (ms)"
    for workload, systems in summary["results"].items():
        if systems:
            rows = []
            for system, sweep in systems.items():
                mid, ratio = _middle_point(sweep), ratio_text(sweep, systems.get("colocated"))
                attained = " / ".join(f"{p['attainment']:.0%}" for p in sweep["points"])
                split = {"split": ", ".join(f"{k} {v:.3f}" for k, v in mid["server_ttft_split_s"].items())}
                figures = cells("{ttft_s[p90]:.2f} | {tpot_s[p90]:ms.0f} | {split} (at {rate:.3g}/s)", mid | split)
                rows.append([system, sweep["goodput"]["text"], ratio, attained, figures])
            lines += [f"### {workload}", "", *table(f"{header} | server TTFT split, mean (s)", rows), ""]
            lines += [f"![TTFT and TPOT CDFs, {workload}](goodput_cdf_{workload}.png)", ""]
    if summary["crosscheck"]:
        lines += ["Harness against the official `openai` client (same requests, one at a time):", ""]
        header = "prompt | output | TTFT harness | TTFT openai | E2E harness | E2E openai"
        times = ("harness_ttft_s", "openai_ttft_s", "harness_e2e_s", "openai_e2e_s")
        rows = [[c["prompt_tokens"], c["max_tokens"], *(f"{c[k]:.3f}" for k in times)] for c in summary["crosscheck"]]
        lines += [*table(header, rows), ""]
    return lines


def ratio_text(sweep: dict, reference: dict | None) -> str:
    """Goodput ratio to the reference, with the direction of any bound (above every rate, below the lowest)."""
    if reference is None:
        return "n/a"
    (mine, ref), lowest = (sweep["goodput"], reference["goodput"]), min(p["rate"] for p in reference["points"])
    if ref["bound"] == "below":  # reference goodput < its lowest rate
        return "n/a (both below the lowest rate)" if mine["bound"] == "below" else f"> {mine['rate'] / lowest:.2f}x"
    value = mine["rate"] / ref["rate"]
    if mine["bound"] == "at_least" and ref["bound"] != "at_least":
        return f">= {value:.2f}x"
    if ref["bound"] == "at_least" and mine["bound"] != "at_least":
        return f"<= {value:.2f}x"
    if mine["bound"] == "below":
        return f"< {lowest / ref['rate']:.2f}x"
    return f"{value:.2f}x" + (" (both above the highest rate)" if mine["bound"] == "at_least" else "")


def main(argv: list[str] | None = None) -> None:
    """Calibrate on plain colocated (always started first), then sweep; SLO-aware systems per workload."""
    options = parse_options(argv)
    requests = workload_requests(options)
    previous = load_previous(options.out, options.raw, list(options.workloads)) if options.merge else None
    command, started, calibration, sweeps = command_line(NAME, argv), time.time(), {}, {}  # system -> workload -> sweep
    checks = previous["crosscheck"] if previous else []
    order = ["colocated"] + [s for s in options.systems if s != "colocated"]
    workloads = tuple(requests)  # (system, the workloads its server runs): an SLO-aware one, one workload each
    servers = [p for s in order for p in ([(s, (w,)) for w in workloads] if s in SLO_AWARE else [(s, workloads)])]
    for index, (system, names) in enumerate(servers):
        slo = workload_slo(calibration[names[0]]) if system in SLO_AWARE else None  # the server's one workload's
        slo_args = {"slo.ttft_ms": f"{slo.ttft_s * 1e3:.1f}", "slo.tpot_ms": f"{slo.tpot_s * 1e3:.1f}"} if slo else {}
        with system_server(system, index, slo_args) as server:
            target = Target(server.url, server.model())
            if not calibration:
                calibration = calibrate(target, requests, options.multipliers)
                checks = checks or crosscheck(target, next(iter(requests.values())))
            for workload in names if system in options.systems else ():
                label, fixed = f"{system}/{workload}", calibration[workload]
                rates, slo, url, seed = fixed["rates"], workload_slo(fixed), server.metrics_url, options.seed
                done = sweep(target, requests[workload], rates, slo, seed=seed, metrics_url=url, label=label)
                print(f"{label}: goodput {done['goodput']['text']} req/s", file=sys.stderr)
                sweeps.setdefault(system, {})[workload] = done
                results = {w: {s: by[w] for s, by in sweeps.items() if w in by} for w in options.workloads}
                report = {"command": command, "elapsed_s": time.time() - started, "model": target.model,
                          "calibration": calibration, "crosscheck": checks, "results": results}  # fmt: skip
                write_report(merged(report, previous), options.out, options.raw)


if __name__ == "__main__":
    main()
