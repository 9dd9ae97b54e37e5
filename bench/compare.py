"""Goodput of disaggregated against colocated serving: ``python -m bench.compare``.

On one machine, one after another, with the same total cores (2 engine replicas, one
torch thread each), it starts each system as a Serve application in a fresh local Ray
cluster, runs the same rate sweep of each workload on it, and stops it cleanly:

* ``colocated``          2 replicas doing both phases, plain continuous batching;
* ``colocated-chunked``  the same with chunked prefill (token budget 256 per step);
* ``disagg-pull``        1 prefill + 1 decode replica, decode pulls the KV over NIXL;
* ``disagg-push``        the same, prefill pushes each layer's KV as it is computed.

SLOs are fixed here as multiples of the uncontended latency measured at the start on the
idle colocated system, one request at a time (Splitwise's method): TTFT <= 5x the TTFT of
the workload's median prompt, TPOT <= 2x the uncontended TPOT. Rates are multiples of
``2 / uncontended E2E`` of the median request (two replicas serving one request each).

Writes ``docs/benchmarks/goodput.{md,json,png}`` and ``goodput_cdf.png``; the per-request
records go to ``--raw`` (not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.serve import Target, run, sweep, uncontended
from bench.slo import SLO
from bench.workloads import make_requests, median_request

HTTP_PORT = 18480
METRICS_PORT = 18490
MAX_MODEL_LEN = 512
TTFT_SLO_X, TPOT_SLO_X = 5.0, 2.0
COMMON = {
    "model.max_model_len": str(MAX_MODEL_LEN),
    "engine.kv_cache_bytes": str(384 << 20),
    "prefill.torch_threads": "1",
    "decode.torch_threads": "1",
    "colocated.torch_threads": "1",
    "colocated.num_replicas": "2",
}
SYSTEMS = {
    "colocated": ("colocated", {}),
    "colocated-chunked": (
        "colocated",
        {"engine.enable_chunked_prefill": "true", "engine.max_num_batched_tokens": "256"},
    ),
    "disagg-pull": ("disagg", {"transport.mode": "pull"}),
    "disagg-push": ("disagg", {"transport.mode": "push"}),
}
# rate points, as multiples of 2 / (uncontended E2E of the median request)
MULTIPLIERS = {
    "summarization": (0.25, 0.5, 0.75, 1.0, 1.25),
    "code": (0.5, 0.75, 1.0, 1.5),
    "chatbot": (0.5, 0.75, 1.0, 1.5),
}
DOC = Path("docs/benchmarks")


# ---- one system ----------------------------------------------------------------------------


class Server:
    """One Serve application in its own local Ray cluster, stopped on exit."""

    def __init__(self, kind: str, args: dict[str, str], index: int) -> None:
        self.kind, self.args, self.index = kind, args, index
        self.url = f"http://127.0.0.1:{HTTP_PORT}"
        self.metrics_url = f"http://127.0.0.1:{METRICS_PORT + index}/metrics"

    def __enter__(self) -> Server:
        from ray import serve

        from app.config import colocated_app, disagg_app
        from bench.ray_local import start_local_ray

        start_local_ray(
            _metrics_export_port=METRICS_PORT + self.index,
            _system_config={"metrics_report_interval_ms": 1000},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
        builder = colocated_app if self.kind == "colocated" else disagg_app
        serve.run(builder(dict(self.args)), name="bench", route_prefix="/")
        httpx.get(self.url + "/ready", timeout=60).raise_for_status()
        # Ctrl-C and SIGTERM must end the run (and stop this cluster in __exit__)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        time.sleep(2)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


# ---- the independent check ---------------------------------------------------------------


def crosscheck(target: Target, requests, num: int = 4) -> list[dict]:
    """The same requests, one at a time, through this harness and through the official
    ``openai`` client (timed around its streaming call)."""
    from openai import OpenAI

    client = OpenAI(base_url=target.url + "/v1", api_key="unused", timeout=300)
    rows = []
    for request in requests[:num]:
        record = asyncio.run(run(target, [request], [0.0], progress=False))[0][0]
        start = time.perf_counter()
        first = None
        stream = client.completions.create(
            model=target.model,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
        end = time.perf_counter()
        rows.append(
            {
                "prompt_tokens": request.prompt_tokens,
                "max_tokens": request.max_tokens,
                "harness_ttft_s": record.ttft,
                "openai_ttft_s": first - start,
                "harness_e2e_s": record.e2e,
                "openai_e2e_s": end - start,
            }
        )
    return rows


# ---- the comparison ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.compare", description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    multipliers = dict(MULTIPLIERS)
    for item in args.multipliers.replace(";", " ").split():
        name, _, values = item.partition("=")
        multipliers[name] = tuple(float(v) for v in values.split(","))
    systems = [s for s in args.systems.split(",") if s]
    for name in workloads:
        if name not in MULTIPLIERS:
            sys.exit(f"unknown workload {name!r}: choose from {', '.join(MULTIPLIERS)}")
    for name in systems:
        if name not in SYSTEMS:
            sys.exit(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    from engine.loader import ModelSpec, load_tokenizer

    tokenizer = load_tokenizer(ModelSpec())
    requests = {w: make_requests(w, tokenizer, MAX_MODEL_LEN, args.num_requests, args.seed) for w in workloads}
    started = time.time()
    calibration: dict[str, dict] = {}
    slos: dict[str, SLO] = {}
    rates: dict[str, list[float]] = {}
    results: dict[str, dict[str, dict]] = {w: {} for w in workloads}  # workload -> system -> sweep
    checks: list[dict] = []
    model = None
    command, elapsed_before = argv_text(argv), 0.0
    if args.merge:
        previous = load_previous(Path(args.out), Path(args.raw), workloads)
        results = {**previous["results"], **results}
        calibration.update(previous["calibration"])
        slos.update(previous["slos"])
        checks = previous["checks"]
        command = f"{previous['command']} && {command}"
        elapsed_before = previous["elapsed_s"]
    # calibrate on the plain colocated system, then run every system
    order = ["colocated"] + [s for s in systems if s != "colocated"]
    for index, system in enumerate(order):
        kind, extra = SYSTEMS[system]
        with Server(kind, {**COMMON, **extra}, index) as server:
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            target = Target(server.url, model)
            if any(w not in rates for w in workloads):  # first system: calibrate this run's workloads
                for w in workloads:
                    median = median_request(requests[w])
                    base = uncontended(target, median, max_tokens=32)
                    outputs = statistics.median(r.max_tokens for r in requests[w])
                    e2e = base["ttft_s"] + (outputs - 1) * base["tpot_s"]
                    slos[w] = SLO(TTFT_SLO_X * base["ttft_s"], TPOT_SLO_X * base["tpot_s"])
                    rates[w] = [round(m * 2 / e2e, 4) for m in multipliers[w]]
                    calibration[w] = {
                        **base,
                        "median_output_tokens": outputs,
                        "e2e_s": e2e,
                        "multipliers": multipliers[w],
                        "rates": rates[w],
                    }
                    print(f"{w}: uncontended {base}, SLO {slos[w]}, rates {rates[w]}", file=sys.stderr)
                checks = checks or crosscheck(target, requests[workloads[0]])
            if system not in systems:
                continue
            for w in workloads:
                label = f"{system}/{w}"
                results[w][system] = sweep(
                    target, requests[w], rates[w], slos[w], seed=args.seed, metrics_url=server.metrics_url, label=label
                )
                print(f"{label}: goodput {results[w][system]['goodput']['text']} req/s", file=sys.stderr)
                elapsed = elapsed_before + time.time() - started  # the report is rewritten after every sweep
                write_report(
                    Path(args.out), Path(args.raw), results, calibration, slos, checks, command, elapsed, model
                )


def load_previous(out: Path, raw: Path, skip: list[str]) -> dict:
    """The workloads of the last report that this run does not repeat."""
    summary = json.loads((out / "goodput.json").read_text())
    full = json.loads((raw / "goodput_full.json").read_text())
    kept = [w for w in full if w not in skip and full[w]]
    return {
        "results": {w: full[w] for w in kept},
        "calibration": {w: summary["calibration"][w] for w in kept},
        "slos": {w: SLO(summary["slo_s"][w]["ttft"], summary["slo_s"][w]["tpot"]) for w in kept},
        "checks": summary.get("crosscheck", []),
        "command": summary["command"],
        "elapsed_s": summary["elapsed_s"],
    }


def argv_text(argv: list[str] | None) -> str:
    return "python -m bench.compare" + ("" if not (argv or sys.argv[1:]) else " " + " ".join(argv or sys.argv[1:]))


# ---- the report ----------------------------------------------------------------------------

BEGIN, END = "<!-- generated by bench.compare: begin -->", "<!-- generated by bench.compare: end -->"


def write_report(out, raw, results, calibration, slos, checks, command, elapsed_s, model) -> None:
    from bench.plots import plot_attainment, plot_cdfs

    out.mkdir(parents=True, exist_ok=True)
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "goodput_full.json").write_text(json.dumps(results))
    plot_attainment(results, out / "goodput.png")
    summary = {
        "command": command,
        "machine": machine(),
        "model": model,
        "elapsed_s": elapsed_s,
        "slo_multiples": {"ttft": TTFT_SLO_X, "tpot": TPOT_SLO_X},
        "calibration": calibration,
        "slo_s": {w: {"ttft": s.ttft_s, "tpot": s.tpot_s} for w, s in slos.items()},
        "crosscheck": checks,
        "results": {
            w: {
                s: {
                    "goodput": r["goodput"],
                    "points": [{k: v for k, v in p.items() if k != "records"} for p in r["points"]],
                }
                for s, r in systems.items()
            }
            for w, systems in results.items()
        },
    }
    (out / "goodput.json").write_text(json.dumps(summary, indent=1))
    lines = [BEGIN, "", f"Command: `{command}` ({elapsed_s / 60:.0f} min). Machine: {machine()}.", ""]
    lines += ["SLOs (TTFT 5x, TPOT 2x the uncontended latency on the idle colocated system):", ""]
    lines += ["| workload | uncontended TTFT | uncontended TPOT | TTFT SLO | TPOT SLO | rates (req/s) |"]
    lines += ["|---|---|---|---|---|---|"]
    for w, slo in slos.items():
        c = calibration[w]
        rate_text = ", ".join(f"{r:.3g}" for r in c["rates"])
        lines.append(
            f"| {w} | {c['ttft_s']:.3f} s ({c['prompt_tokens']} tok) | {c['tpot_s'] * 1e3:.0f} ms | "
            f"{slo.ttft_s:.3f} s | {slo.tpot_s * 1e3:.0f} ms | {rate_text} |"
        )
    lines += ["", "![attainment against rate](goodput.png)", ""]
    for w, systems in results.items():
        if not systems:
            continue
        lines += [f"### {w}", ""]
        lines += [
            "| system | goodput (req/s) | vs colocated | attainment per rate | TTFT p90 (s) | TPOT p90 (ms) | "
            "server TTFT split, mean (s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for s, r in systems.items():
            pts = r["points"]
            mid = pts[len(pts) // 2]
            ratio = ratio_text(r, systems.get("colocated"))
            attained = " / ".join(f"{p['attainment']:.0%}" for p in pts)
            split = ", ".join(f"{k} {v:.3f}" for k, v in mid["server_ttft_split_s"].items())
            lines.append(
                f"| {s} | {r['goodput']['text']} | {ratio} | {attained} | "
                f"{mid['ttft_s']['p90']:.2f} | {mid['tpot_s']['p90'] * 1e3:.0f} | {split} (at {mid['rate']:.3g}/s) |"
            )
        lines.append("")
        plot_cdfs({s: r["points"][len(r["points"]) // 2] for s, r in systems.items()}, out / f"goodput_cdf_{w}.png", w)
        lines += [f"![TTFT and TPOT CDFs, {w}](goodput_cdf_{w}.png)", ""]
    if checks:
        lines += ["Harness against the official `openai` client (same requests, one at a time):", ""]
        lines += ["| prompt | output | TTFT harness | TTFT openai | E2E harness | E2E openai |"]
        lines += ["|---|---|---|---|---|---|"]
        for c in checks:
            lines.append(
                f"| {c['prompt_tokens']} | {c['max_tokens']} | {c['harness_ttft_s']:.3f} | {c['openai_ttft_s']:.3f} | "
                f"{c['harness_e2e_s']:.3f} | {c['openai_e2e_s']:.3f} |"
            )
        lines.append("")
    lines.append(END)
    generated = "\n".join(lines)
    path = out / "goodput.md"
    old = path.read_text() if path.exists() else f"# Goodput: disaggregated against colocated\n\n{BEGIN}\n{END}\n"
    if BEGIN in old and END in old:
        text = old[: old.index(BEGIN)] + generated + old[old.index(END) + len(END) :]
    else:
        text = old + "\n" + generated + "\n"
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)


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


def machine() -> str:
    import os

    import psutil
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, torch {torch.__version__}, {gpu}"
    )


if __name__ == "__main__":
    main()
