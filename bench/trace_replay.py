"""The Azure conversation trace through the served app on this machine, beside the simulator's prediction of the same
replay: ``python -m bench.trace_replay``.

A window of ``workloads/traces/azure_llm_2023_conv.csv``, lengths scaled to the default model (``scaled``: the median
request, 1,020 + 129 tokens, becomes 128 + 32), thinned to one request in ``m`` at the trace's own times, ``m`` the
smallest keeping the mean load under ``--load`` of 1 + 1's measured goodput (``planner.json``). Systems ``static``,
``colocated`` and ``elastic`` (counts fixed), each in its own local Ray, SLOs as bench.compare's; beside each the
simulator's prediction, and bench.drift's shapes timed before and after (the machine's drift)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from autoscaling.policy import Scaling, load_policy
from bench.calibrate_planner import Prompts, core
from bench.drift import sample
from bench.elastic import SYSTEMS, binned, each_system
from bench.host import machine, tokenizer
from bench.report import arguments, cells, command_line, publish, read_json, subset, table
from bench.serve import run, warm_up
from bench.slo import SLO, distribution
from planner import replay
from planner.costs import DEFAULT_CALIBRATION
from planner.sim_types import SimRequest
from planner.simulator import simulate
from planner.trace import read_trace, window
from workloads import BenchRequest, PromptBuilder

NAME = "bench.trace_replay"
ROOT = Path(__file__).parents[1]
TRACE = ROOT / "workloads" / "traces" / "azure_llm_2023_conv.csv"
GOODPUT = ROOT / "docs" / "benchmarks" / "planner.json"  # bench.planner_check's
DRIFT = ROOT / "docs" / "benchmarks" / "drift.json"  # the shapes beside the calibration
PROMPT_DIV, PROMPT_RANGE = 8, (16, 384)
OUTPUT_DIV, OUTPUT_RANGE = 4, (8, 96)
CAPACITY_COMPRESSION = 4.0  # the window offered this much faster to find what 1 + 1 completes
MINUTE_S = 60.0
ROW = (  # one system: measured / predicted, and their difference
    "{name} | {m[attainment]:.0%} / {p[attainment]:.0%} | {diff:+.0f} | {m[ttft_attainment]:.0%} / "
    "{p[ttft_attainment]:.0%} | {m[tpot_attainment]:.0%} / {p[tpot_attainment]:.0%} | {m[ttft_p90_s]:ms.0f} / "
    "{p[ttft_p90_s]:ms.0f} | {m[tpot_p90_s]:ms.0f} / {p[tpot_p90_s]:ms.0f} | {m[errors]}"
)
SHAPE = "{k} | {r:ms.1f} | {b:ms.1f} | {a:ms.1f} | {br:.2f} | {ar:.2f}"
HEADER = ("system (measured / predicted) | attainment | predicted - measured (points) | TTFT met | TPOT met | "
          "TTFT p90 (ms) | TPOT p90 (ms) | errors")  # fmt: skip


def _clip(value: float, bounds: tuple[int, int]) -> int:
    return int(min(max(round(value), bounds[0]), bounds[1]))


def scaled(requests: list[SimRequest]) -> list[SimRequest]:
    return [SimRequest(r.arrival_s, _clip(r.prompt_tokens / PROMPT_DIV, PROMPT_RANGE),
                       _clip(r.output_tokens / OUTPUT_DIV, OUTPUT_RANGE)) for r in requests]  # fmt: skip


def _sim_args(system: str, slo: SLO) -> argparse.Namespace:
    sim: dict[str, Any] = {"colocated": 2} if system == "colocated" else {"prefill": 1, "decode": 1}  # as served
    if system == "elastic":
        sim["policy"] = load_policy("default").model_copy(update={"scaling": Scaling(enabled=False)})
    return replay.with_defaults(calibration=DEFAULT_CALIBRATION, slo_ttft=slo.ttft_s, slo_tpot=slo.tpot_s, **sim)


def served_capacity() -> float:
    """1 prefill + 1 decode replica's measured goodput (req/s), from bench.planner_check's report."""
    return read_json(GOODPUT)["systems"]["disagg-pull"]["goodput"]


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
    """(arrival, TTFT, TPOT; TTFT None: failed) per request -> attainment (both, TTFT, TPOT), p90s, per minute, rows."""
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


def drift_sample() -> dict[str, float]:
    engine = core()
    sample(engine, prompts := Prompts(engine.tokenizer))  # warm-up
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
    data: dict[str, Any] = {"command": command_line(NAME, argv), "machine": machine(), "trace": TRACE.name,
                            "start_s": options.start_s, "window_s": options.window_s, "load": options.load,
                            "thinning": m, "capacity_rps": cap, "requests": len(requests),
                            "simulated_throughput_rps": simulated_throughput(chosen),
                            "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / len(requests),
                            "mean_output_tokens": sum(r.output_tokens for r in requests) / len(requests),
                            "drift_reference": {"started": (drift := read_json(DRIFT))["started"],
                                                "median_s": {k: v["median_s"] for k, v in drift["summary"].items()}},
                            "drift_before": drift_sample(),
                            "systems": {}}  # fmt: skip
    # SLOs from the idle colocated system's median request (one class: bench.elastic's summarized prompts)
    for system, target, calibration in each_system(options.systems, None, {"prompt": bench}):
        slo = calibration.slo("prompt")
        data["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "uncontended": calibration.classes["prompt"]}
        warm_up(target, bench[:2])
        records, duration = asyncio.run(run(target, bench, offsets, system))
        errors = sum(not r.ok for r in records)
        measured = [(offset, r.ttft if r.ok else None, r.tpot if r.ok else None) for offset, r in zip(offsets, records)]
        sim = simulate(replay.setup(_sim_args(system, slo)).system, requests)
        predicted = sorted((r.arrival_s, r.ttft_s, r.tpot_s) for r in sim.records)
        found = data["systems"][system] = {
            "measured": outcome(measured, slo, minutes) | {"errors": errors, "duration_s": duration},
            "predicted": outcome(predicted, slo, minutes) | {"routes": sim.routes}}  # fmt: skip
        print(f"{system}: {json.dumps({k: v['attainment'] for k, v in found.items()})}", file=sys.stderr)
    data["drift_after"] = drift_sample()
    return data


def render(data: dict[str, Any]) -> list[str]:
    slo, systems = data["slo"], data["systems"]
    lines = ["", f"Command: `{data['command']}`; {data['machine']}.",
             f"Trace window {data['start_s']:g}-{data['start_s'] + data['window_s']:g} s, 1 request in "
             f"{data['thinning']} kept ({data['requests']} requests, mean {data['mean_prompt_tokens']:.0f} prompt + "
             f"{data['mean_output_tokens']:.0f} output tokens), mean load {data['load']:g} of 1 + 1's "
             f"{data['capacity_rps']:.2f} req/s measured goodput (the simulated 1 + 1 completes "
             f"{data['simulated_throughput_rps']:.2f} req/s in overload).",
             f"SLOs: TTFT {slo['ttft_s'] * 1e3:.0f} ms, TPOT {slo['tpot_s'] * 1e3:.0f} ms.", ""]  # fmt: skip
    both = [{"name": n, "m": s["measured"], "p": s["predicted"]} for n, s in systems.items()]
    lines += table(HEADER, [cells(ROW, b | {"diff": 100 * (b["p"]["attainment"] - b["m"]["attainment"])}, "-")
                            for b in both])  # fmt: skip
    lines += ["", "Per minute (measured / predicted):", ""]
    minutes = [[b["name"], *(cells("{m:.0%} / {p:.0%}", {"m": m, "p": p}, "-")
                             for m, p in zip(b["m"]["per_minute"], b["p"]["per_minute"]))] for b in both]  # fmt: skip
    lines += table(["system", *map(str, range(len(both[0]["m"]["per_minute"])))], minutes)
    ref, after = data["drift_reference"], data["drift_after"]
    lines += ["", "The machine's speed over the run: bench.drift's shapes before and after the systems, against "
              f"their medians in `drift.json` ({ref['started']}, beside the calibration the predictions use):",
              ""]  # fmt: skip
    shapes = [{"k": k, "r": (r := ref["median_s"][k]), "b": b, "a": after[k], "br": b / r, "ar": after[k] / r}
              for k, b in data["drift_before"].items()]  # fmt: skip
    header = "shape | at calibration (ms) | before (ms) | after (ms) | before / at calibration | after / at calibration"
    lines += table(header, [cells(SHAPE, row) for row in shapes])
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = arguments(NAME, __doc__, "docs/benchmarks", "folder for trace_replay.md/json")
    parser.add_argument("--start-s", type=float, default=1800.0, help="the window's start in the trace (s)")
    parser.add_argument("--window-s", type=float, default=600.0)
    parser.add_argument("--load", type=float, default=0.6, help="mean load as a share of 1 + 1's capacity")
    parser.add_argument("--systems", **subset(SYSTEMS))
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    data = run_all(options, argv)
    title = "# The production trace on this machine, served and simulated"
    publish(options.out, "trace_replay", NAME, data, lines := render(data), title)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
