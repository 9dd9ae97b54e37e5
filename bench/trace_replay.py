"""The Azure conversation trace through the served app on this machine, beside the simulator's
prediction of the same replay: ``python -m bench.trace_replay``.

A window of ``workloads/traces/azure_llm_2023_conv.csv`` (``--start-s``, ``--window-s``) with its
lengths scaled to the default model (``scaled``: prompt / 8 clipped to 16..384 tokens, output / 4
clipped to 8..96: the trace's median request, 1,020 + 129 tokens, becomes 128 + 32, within the
benchmark's 512-token context), thinned to one request in ``m`` at the trace's own times, ``m``
the smallest keeping the mean load under ``--load`` of what 1 prefill + 1 decode replica serve:
their measured goodput in ``docs/benchmarks/planner.json`` (bench.planner_check's chatbot
workload, median prompt 118 tokens, about 31 output: these lengths). The simulator's throughput
for 1 + 1 offered the window 4x compressed is recorded beside it: it is not the capacity, as the
calibration was checked up to 90% of that goodput, not in overload (a first run sized from it
offered 1.7 req/s and the static system completed about 0.9). Thinning rather than stretching
keeps the window's length and the shape of its bursts in a run this machine finishes in minutes
per system.

Three systems, each in its own local Ray, in one run: ``static`` (1 prefill + 1 decode),
``colocated`` (2 replicas), ``elastic`` (the default policy's lending and prompt placement, counts
fixed); SLOs as bench.compare's (multiples of the idle colocated system's median request). Beside
each, the simulator's prediction from the calibration, and bench.drift's shapes timed before and
after the systems, so a prediction that misses can be set against the machine's own drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from bench.elastic import SYSTEMS, binned, each_system, parse_systems
from bench.host import machine, tokenizer
from bench.report import command_line, first_paragraph, table, template, write_json, write_page
from bench.serve import Target, run, warm_up
from bench.slo import SLO, distribution
from planner import replay
from planner.sim_types import SimRequest
from planner.simulator import simulate
from planner.trace import read_trace, window
from workloads import BenchRequest, PromptBuilder

NAME = "bench.trace_replay"
TRACE = Path(__file__).parents[1] / "workloads" / "traces" / "azure_llm_2023_conv.csv"
CALIBRATION = Path(__file__).parents[1] / "planner" / "calibration" / "cpu-2core.json"
GOODPUT = Path(__file__).parents[1] / "docs" / "benchmarks" / "planner.json"  # bench.planner_check's
DRIFT = Path(__file__).parents[1] / "docs" / "benchmarks" / "drift.json"  # the shapes beside the calibration
PROMPT_DIV, PROMPT_RANGE = 8, (16, 384)
OUTPUT_DIV, OUTPUT_RANGE = 4, (8, 96)
CAPACITY_COMPRESSION = 4.0  # the window offered this much faster to find what 1 + 1 completes
MINUTE_S = 60.0


def _clip(value: float, bounds: tuple[int, int]) -> int:
    return int(min(max(round(value), bounds[0]), bounds[1]))


def scaled(requests: list[SimRequest]) -> list[SimRequest]:
    """The trace's lengths scaled to the default model (module docstring)."""
    return [SimRequest(r.arrival_s, _clip(r.prompt_tokens / PROMPT_DIV, PROMPT_RANGE),
                       _clip(r.output_tokens / OUTPUT_DIV, OUTPUT_RANGE)) for r in requests]  # fmt: skip


def _sim_args(system: str, slo: SLO, **extra: Any) -> argparse.Namespace:
    from autoscaling.policy import Scaling, load_policy

    sim: dict[str, Any] = {"colocated": 2} if system == "colocated" else {"prefill": 1, "decode": 1}  # as served
    if system == "elastic":
        sim["policy"] = load_policy("default").model_copy(update={"scaling": Scaling(enabled=False)})
    return replay.with_defaults(calibration=CALIBRATION, slo_ttft=slo.ttft_s, slo_tpot=slo.tpot_s, **sim, **extra)


def served_capacity() -> float:
    """1 prefill + 1 decode replica's measured goodput (req/s), from bench.planner_check's report."""
    return json.loads(GOODPUT.read_text())["systems"]["disagg-pull"]["goodput"]


def simulated_throughput(requests: list[SimRequest]) -> float:
    """Requests per second the simulated 1 + 1 completes, offered the window compressed."""
    offered = [SimRequest(r.arrival_s / CAPACITY_COMPRESSION, r.prompt_tokens, r.output_tokens) for r in requests]
    result = simulate(replay.setup(_sim_args("static", SLO(1.0, 1.0))).system, offered)
    return len(offered) / max(r.arrival_s + r.e2e_s for r in result.records)


def thinned(requests: list[SimRequest], load: float, cap: float) -> tuple[list[SimRequest], int]:
    """One request in ``m`` (a seeded choice in each run of ``m``), ``m`` the smallest keeping the
    mean rate under ``load`` x ``cap`` (req/s); the kept requests and ``m``."""
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    m = max(1, math.ceil(len(requests) / span / (load * cap)))
    rng = random.Random(0)
    kept = [group[rng.randrange(len(group))] for group in (requests[i : i + m] for i in range(0, len(requests), m))]
    start = kept[0].arrival_s
    return [SimRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens) for r in kept], m


def outcome(rows: list[tuple[float, float | None, float | None]], slo: SLO, minutes: int) -> dict[str, Any]:
    """(arrival, TTFT, TPOT; TTFT None: failed) per request -> attainment (both, TTFT, TPOT),
    p90s, per minute, and the rows."""
    ttft_ok = [ttft is not None and ttft <= slo.ttft_s for _, ttft, _ in rows]
    tpot_ok = [ttft is not None and (tpot is None or tpot <= slo.tpot_s) for _, ttft, tpot in rows]
    met = [a and b for a, b in zip(ttft_ok, tpot_ok)]
    ttfts = [t for _, t, _ in rows if t is not None]
    tpots = [t for _, _, t in rows if t is not None]
    return {"attainment": sum(met) / len(rows), "ttft_attainment": sum(ttft_ok) / len(rows),
            "tpot_attainment": sum(tpot_ok) / len(rows),
            "ttft_p90_s": distribution(ttfts)["p90"] if ttfts else None,
            "tpot_p90_s": distribution(tpots)["p90"] if tpots else None,
            "per_minute": binned([(a, m) for (a, _, _), m in zip(rows, met)], MINUTE_S, minutes, None),
            "requests": [[round(a, 3), None if t is None else round(t, 4), None if p is None else round(p, 5)]
                         for a, t, p in rows]}  # fmt: skip


def predict(system: str, requests: list[SimRequest], slo: SLO, minutes: int) -> dict[str, Any]:
    result = simulate(replay.setup(_sim_args(system, slo)).system, requests)
    rows = sorted((r.arrival_s, r.ttft_s, r.tpot_s) for r in result.records)
    return outcome(rows, slo, minutes) | {"routes": result.routes}


def served(target: Target, system: str, slo: SLO, requests: list, offsets: list[float], minutes: int) -> dict[str, Any]:
    warm_up(target, requests[:2])
    records, duration = asyncio.run(run(target, requests, offsets, system))
    rows = [(offset, r.ttft if r.ok else None, r.tpot if r.ok else None) for offset, r in zip(offsets, records)]
    return outcome(rows, slo, minutes) | {"errors": sum(not r.ok for r in records), "duration_s": duration}


def drift_reference() -> dict[str, Any]:
    """bench.drift's shapes (medians) as measured the day the calibration was taken."""
    data = json.loads(DRIFT.read_text())
    return {"started": data["started"], "median_s": {k: v["median_s"] for k, v in data["summary"].items()}}


def drift_sample() -> dict[str, float]:
    """bench.drift's shapes, timed once on an engine in this process."""
    from bench.calibrate_planner import Prompts, core
    from bench.drift import sample

    engine = core()
    prompts = Prompts(engine.tokenizer)
    sample(engine, prompts)  # warm-up
    return sample(engine, prompts)


def run_all(options: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    chosen = scaled(window(read_trace(TRACE), options.start_s, options.window_s))
    cap = served_capacity()
    requests, m = thinned(chosen, options.load, cap)
    minutes = math.ceil(options.window_s / MINUTE_S)
    builder, rng = PromptBuilder(tokenizer()), random.Random(options.seed)
    bench = [BenchRequest(builder.summarization(r.prompt_tokens, rng.randrange(10_000)), r.prompt_tokens,
                          r.output_tokens) for r in requests]  # fmt: skip
    offsets = [r.arrival_s for r in requests]
    print(f"{len(chosen)} trace requests, 1 in {m} kept: {len(requests)}; capacity {cap:.2f} req/s", file=sys.stderr)
    data: dict[str, Any] = {"command": command_line(NAME, argv), "machine": machine(), "trace": str(TRACE.name),
                            "start_s": options.start_s, "window_s": options.window_s, "load": options.load,
                            "thinning": m, "capacity_rps": cap, "requests": len(requests),
                            "simulated_throughput_rps": simulated_throughput(chosen),
                            "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / len(requests),
                            "mean_output_tokens": sum(r.output_tokens for r in requests) / len(requests),
                            "drift_reference": drift_reference(), "drift_before": drift_sample(),
                            "systems": {}}  # fmt: skip
    # SLOs from the idle colocated system's median request (one class: bench.elastic's summarized prompts)
    for system, target, calibration in each_system(options.systems, None, {"prompt": bench}):
        slo = calibration.slo("prompt")
        data["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "uncontended": calibration.classes["prompt"]}
        data["systems"][system] = {"measured": served(target, system, slo, bench, offsets, minutes),
                                   "predicted": predict(system, requests, slo, minutes)}  # fmt: skip
        print(f"{system}: {json.dumps({k: v['attainment'] for k, v in data['systems'][system].items()})}",
              file=sys.stderr)  # fmt: skip
    data["drift_after"] = drift_sample()
    return data


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def render(data: dict[str, Any]) -> list[str]:
    slo = data["slo"]
    lines = ["", f"Command: `{data['command']}`; {data['machine']}.",
             f"Trace window {data['start_s']:g}-{data['start_s'] + data['window_s']:g} s, 1 request in "
             f"{data['thinning']} kept ({data['requests']} requests, mean {data['mean_prompt_tokens']:.0f} prompt + "
             f"{data['mean_output_tokens']:.0f} output tokens), mean load {data['load']:g} of 1 + 1's "
             f"{data['capacity_rps']:.2f} req/s measured goodput (the simulated 1 + 1 completes "
             f"{data['simulated_throughput_rps']:.2f} req/s in overload).",
             f"SLOs: TTFT {slo['ttft_s'] * 1e3:.0f} ms, TPOT {slo['tpot_s'] * 1e3:.0f} ms.", ""]  # fmt: skip

    def both(s: dict[str, Any], key: str, fmt: Any) -> str:
        return f"{fmt(s['measured'][key])} / {fmt(s['predicted'][key])}"

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    rows = [[name, both(s, "attainment", _pct),
             f"{100 * (s['predicted']['attainment'] - s['measured']['attainment']):+.0f}",
             both(s, "ttft_attainment", _pct), both(s, "tpot_attainment", _pct), both(s, "ttft_p90_s", ms),
             both(s, "tpot_p90_s", ms), s["measured"]["errors"]] for name, s in data["systems"].items()]  # fmt: skip
    lines += table(["system (measured / predicted)", "attainment", "predicted - measured (points)", "TTFT met",
                    "TPOT met", "TTFT p90 (ms)", "TPOT p90 (ms)", "errors"], rows)  # fmt: skip
    lines += ["", "Per minute (measured / predicted):", ""]
    minutes = len(next(iter(data["systems"].values()))["measured"]["per_minute"])
    lines += table(["system", *(str(m) for m in range(minutes))],
                   [[name, *(f"{_pct(a)} / {_pct(b)}" for a, b in zip(s["measured"]["per_minute"],
                                                                  s["predicted"]["per_minute"]))]
                    for name, s in data["systems"].items()])  # fmt: skip
    before, after, ref = data["drift_before"], data["drift_after"], data["drift_reference"]
    lines += [
        "",
        f"The machine's speed over the run: bench.drift's shapes before and after the systems, against "
        f"their medians in `drift.json` ({ref['started']}, beside the calibration the predictions use):",
        "",
    ]
    lines += table(["shape", "at calibration (ms)", "before (ms)", "after (ms)", "before / at calibration",
                    "after / at calibration"],
                   [[k, f"{ref['median_s'][k] * 1e3:.1f}", f"{before[k] * 1e3:.1f}", f"{after[k] * 1e3:.1f}",
                     f"{before[k] / ref['median_s'][k]:.2f}", f"{after[k] / ref['median_s'][k]:.2f}"]
                    for k in before])  # fmt: skip
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=NAME, description=first_paragraph(__doc__))
    parser.add_argument("--start-s", type=float, default=1800.0, help="the window's start in the trace (s)")
    parser.add_argument("--window-s", type=float, default=600.0)
    parser.add_argument("--load", type=float, default=0.6, help="mean load as a share of 1 + 1's capacity")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    options = parser.parse_args(argv)
    options.systems = list(parse_systems(options.systems, SYSTEMS))
    data = run_all(options, argv)
    write_json(options.out / "trace_replay.json", data)
    page = options.out / "trace_replay.md"
    lines = render(data)
    write_page(page, NAME, lines, template(NAME, "# The production trace on this machine, served and simulated"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
