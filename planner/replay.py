"""``python -m planner simulate``: what a system and its autoscaling policy do on a request trace.

    python -m planner simulate --trace workloads/traces/azure_llm_2023_conv.csv \\
        --model <config.json> --gpu h100 --prefill 4 --decode 4 --policy default \\
        --slo-ttft 2 --slo-tpot 0.1 [--rate-scale K] [--startup-s 60] --out DIR

The trace (``planner.trace``: the Azure CSV or JSONL) runs through ``planner.simulator`` with
the cost of one replica from the roofline of ``--model`` on ``--gpu`` at each pool's TP degree
(or from a CPU calibration, ``--calibration``), and, with ``--policy``, the autoscaler's own
functions deciding lends, reclaims, prompt placement and pool sizes (``planner.sim_elastic``).
The policy's SLO targets are replaced by ``--slo-ttft`` / ``--slo-tpot``, as the app's
``slo`` settings replace them when served.

Writes ``DIR/simulation.json`` (the inputs; per window and overall: SLO attainment of TTFT,
TPOT and both, their p90s, goodput, GPU-hours; every decision with its reason; the replicas
over time) and ``DIR/timeline.png`` (arrivals, replicas per role, attainment per window).
A bad input exits with code 2 and a message naming the file, line or field; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from autoscaling.policy import Policy, SLOTargets, load_policy
from planner.costs import CostModel, load_calibration
from planner.gpu_cost import HostBoundCost, device_cost, load_gpu_calibration
from planner.roofline import Hardware, ModelShape, RooflineCost, load_hardware, model_shape
from planner.sim_types import ElasticWorld, PoolSample, SimRecord, SimRequest, SimResult, SystemSpec
from planner.simulator import simulate
from planner.trace import TraceError, read_trace, scale_rate, window


class InputError(ValueError):
    """A bad input of the command line: the message names the file, line or field."""


@dataclass(frozen=True)
class Setup:
    """What one simulation runs: the system, the devices per replica of each pool, the SLOs."""

    system: SystemSpec
    gpus: dict[str, int]  # devices per replica, by pool
    ttft_slo_s: float
    tpot_slo_s: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, type=Path, help="Azure CSV or JSONL trace")
    p.add_argument("--model", help="a Hugging Face config.json or the model directory holding it")
    p.add_argument("--gpu", help="h100, h200, a100, l40s, or a hardware YAML file")
    p.add_argument(
        "--engine",
        default="roofline",
        help="the GPU engine's speed: roofline (the planner's), a gpu-host calibration (h200-fused, h200-graphs,"
        " h200-eager or a path: the roofline plus the host's time per layer measured) or a factor on it (1.2x)",
    )
    p.add_argument("--calibration", type=Path, help="a measured CPU calibration instead of --model/--gpu")
    p.add_argument("--policy", help="autoscaling policy: a shipped name (default, ...) or a YAML path; none: static")
    p.add_argument("--prefill", type=int, default=1, help="prefill replicas at the start")
    p.add_argument("--decode", type=int, default=1, help="decode replicas at the start")
    p.add_argument("--colocated", type=int, help="N colocated replicas (both phases, chunked prefill) instead")
    p.add_argument("--tp-prefill", type=int, default=1, help="tensor-parallel degree of a prefill replica")
    p.add_argument("--tp-decode", type=int, default=1, help="tensor-parallel degree of a decode (or colocated) replica")
    p.add_argument("--slo-ttft", type=float, required=True, help="time-to-first-token objective (p90), seconds")
    p.add_argument("--slo-tpot", type=float, required=True, help="time-per-output-token objective (p90), seconds")
    p.add_argument("--rate-scale", type=int, default=1, help="replay each request K times (sub-second jitter)")
    p.add_argument("--startup-s", type=float, default=60.0, help="a scale-up decision to the new replica serving")
    p.add_argument("--report-delay-s", type=float, default=1.0, help="how old the loads the controller sees are")
    p.add_argument("--never-start", type=float, default=0.0, help="share of new replicas that never start")
    p.add_argument("--start-s", type=float, default=0.0, help="replay the trace from this second")
    p.add_argument("--duration-s", type=float, help="replay this many seconds of the trace (default: all)")
    p.add_argument("--window-s", type=float, default=300.0, help="attainment per window of this length")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per engine step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write simulation.json and timeline.png here")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message)


def _policy(name: str | Policy | None, ttft_s: float, tpot_s: float) -> Policy | None:
    """The policy named (or given, from code), its SLO targets the simulation's."""
    if name is None or name == "none":
        return None
    try:
        policy = name if isinstance(name, Policy) else load_policy(name)
    except (OSError, ValueError, ValidationError) as exc:
        raise InputError(f"--policy {name}: {exc}") from None
    return policy.model_copy(update={"slo": SLOTargets(ttft_p90_ms=ttft_s * 1e3, tpot_p90_ms=tpot_s * 1e3)})


def _costs(args: argparse.Namespace) -> tuple[CostModel, CostModel, dict[str, Any]]:
    """The prefill and decode replicas' costs, and the system fields the cost source sets."""
    if args.calibration is not None:
        _check(args.model is None and args.gpu is None, "give --calibration or --model/--gpu, not both")
        _check(args.tp_prefill == args.tp_decode == 1, "--calibration: a measured CPU replica has no TP degree")
        try:
            cost = load_calibration(args.calibration)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"--calibration {args.calibration}: {exc!r}") from None
        kind = "colocated" if args.colocated else "disaggregated"
        return cost, cost, {"interference": cost.interference, "stack": cost.stack(kind)}
    _check(args.model is not None and args.gpu is not None, "--model and --gpu are needed (or --calibration)")
    try:
        shape, hardware = model_shape(args.model), load_hardware(args.gpu)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--model {args.model} / --gpu {args.gpu}: {exc}") from None
    costs = [_gpu_cost(args.engine, shape, hardware, tp) for tp in (args.tp_prefill, args.tp_decode)]
    for cost, flag, tp in zip(costs, ("--tp-prefill", "--tp-decode"), (args.tp_prefill, args.tp_decode)):
        _check(cost.kv_capacity_tokens > 0, f"{flag} {tp}: the weights leave no room for KV on {hardware.name}")
    return costs[0], costs[1], {}


def _gpu_cost(engine: str, shape: ModelShape, hardware: Hardware, tp: int) -> CostModel:
    if engine == "roofline":
        return RooflineCost(shape, hardware, tp)
    if engine.endswith("x"):
        try:
            return HostBoundCost(device_cost(shape, hardware, tp), None, float(engine[:-1]))
        except ValueError:
            raise InputError(f"--engine {engine}: a factor on the roofline is a number then x (1.2x)") from None
    try:
        return load_gpu_calibration(engine).cost(shape, hardware, tp)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--engine {engine}: {exc}") from None


def setup(args: argparse.Namespace) -> Setup:
    """The system ``args`` describe; ``InputError`` names what is wrong."""
    _check(args.slo_ttft > 0 and args.slo_tpot > 0, "--slo-ttft and --slo-tpot must be > 0")
    _check(args.rate_scale >= 1, f"--rate-scale must be >= 1, got {args.rate_scale}")
    _check(0 <= args.never_start < 1, f"--never-start is a share in [0, 1), got {args.never_start}")
    _check(args.startup_s >= 0 and args.report_delay_s >= 0, "--startup-s and --report-delay-s must be >= 0")
    _check(min(args.prefill, args.decode, args.tp_prefill, args.tp_decode) >= 1, "replica counts and TP must be >= 1")
    _check(args.window_s > 0, "--window-s must be > 0")
    prefill_cost, decode_cost, fields = _costs(args)
    policy = _policy(args.policy, args.slo_ttft, args.slo_tpot)
    world = ElasticWorld(args.startup_s, args.report_delay_s, args.never_start, args.seed)
    common = dict(chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens, world=world, **fields)
    if args.colocated is not None:
        _check(args.colocated >= 1 and policy is None, "--colocated N: N >= 1, and no --policy (lending needs pools)")
        system = SystemSpec("colocated", args.colocated, 0, decode_cost, decode_cost, **common)
        return Setup(system, {"colocated": args.tp_decode}, args.slo_ttft, args.slo_tpot)
    system = SystemSpec("disaggregated", args.prefill, args.decode, prefill_cost, decode_cost, policy=policy, **common)
    return Setup(system, {"prefill": args.tp_prefill, "decode": args.tp_decode}, args.slo_ttft, args.slo_tpot)


# ---- what a run measured ---------------------------------------------------------------------


def _p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


def latency_summary(records: list[SimRecord], ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
    """Attainment of TTFT, of TPOT and of both (a one-token output meets the TPOT half), p90s."""
    if not records:
        return {"requests": 0, "attainment": None, "ttft_attainment": None, "tpot_attainment": None,
                "ttft_p90_s": None, "tpot_p90_s": None}  # fmt: skip
    ttft_ok = [r.ttft_s <= ttft_slo_s for r in records]
    tpot_ok = [r.tpot_s is None or r.tpot_s <= tpot_slo_s for r in records]
    return {
        "requests": len(records),
        "attainment": sum(a and b for a, b in zip(ttft_ok, tpot_ok)) / len(records),
        "ttft_attainment": sum(ttft_ok) / len(records),
        "tpot_attainment": sum(tpot_ok) / len(records),
        "ttft_p90_s": _p90([r.ttft_s for r in records]),
        "tpot_p90_s": _p90([r.tpot_s for r in records if r.tpot_s is not None]),
    }


def summarize(result: SimResult, run: Setup, window_s: float) -> dict[str, Any]:
    """Overall and per-window figures, GPU-hours, decisions and the replicas over time."""
    records = list(result.records)
    end_s = max((r.arrival_s + r.e2e_s for r in records), default=0.0)
    gpu_hours = sum(seconds * run.gpus[pool] for pool, seconds in result.replica_seconds.items()) / 3600
    overall = latency_summary(records, run.ttft_slo_s, run.tpot_slo_s)
    met = sum(r.met(run.ttft_slo_s, run.tpot_slo_s) for r in records)
    overall |= {"duration_s": end_s, "gpu_hours": gpu_hours, "goodput_rps": met / end_s if end_s else 0.0,
                "goodput_per_gpu_hour": met / gpu_hours if gpu_hours else 0.0}  # fmt: skip
    system = run.system
    decode = 0 if system.kind == "colocated" else system.decode_replicas
    fixed = [PoolSample(0.0, system.prefill_replicas, decode, held_prefill=system.prefill_replicas, held_decode=decode)]
    by_window: dict[int, list[SimRecord]] = defaultdict(list)
    for record in records:  # one pass each, not one per window
        by_window[int(record.arrival_s // window_s)].append(record)
    samples_by_window: dict[int, list[PoolSample]] = defaultdict(list)
    for sample in result.timeline:
        samples_by_window[int(sample.time_s // window_s)].append(sample)
    windows = []
    for index in range(max(by_window, default=0) + 1):
        samples = samples_by_window.get(index) or fixed
        mean = {k: float(np.mean([getattr(s, k) for s in samples])) for k in ("prefill", "decode", "lent", "held")}
        windows.append({"start_s": index * window_s, **latency_summary(by_window[index], run.ttft_slo_s,
                        run.tpot_slo_s), "mean_replicas": mean})  # fmt: skip
    return {
        "overall": overall,
        "windows": windows,
        "routes": result.routes,
        "decisions": [asdict(d) for d in result.decisions],
        "timeline": [asdict(s) | {"held": s.held} for s in result.timeline],
    }


def load_requests(args: argparse.Namespace) -> list[SimRequest]:
    """The trace's requests in ``args``' window, at ``args``' rate scale."""
    requests = window(read_trace(args.trace), args.start_s, args.duration_s)
    _check(bool(requests), f"{args.trace}: no request in the window from {args.start_s:g} s")
    return scale_rate(requests, args.rate_scale, seed=args.seed)


def measure(planned: Setup, requests: list[SimRequest], window_s: float) -> dict[str, Any]:
    """Simulate ``requests`` on the planned system: ``summarize``'s figures and the wall time."""
    started = time.perf_counter()
    result = simulate(planned.system, requests)
    wall_s = time.perf_counter() - started
    return {"gpus_per_replica": planned.gpus, "requests": len(requests), "wall_s": wall_s} | summarize(
        result, planned, window_s
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Read, check, simulate and summarize; ``InputError`` / ``TraceError`` before any work."""
    planned = setup(args)
    requests = load_requests(args)
    inputs = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("func", "command")}
    return {"inputs": inputs} | measure(planned, requests, args.window_s)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(data: dict[str, Any]) -> str:
    """The terminal's summary: overall, then one line per window."""
    o = data["overall"]
    lines = [
        f"{data['requests']} requests simulated in {data['wall_s']:.1f} s; {len(data['decisions'])} decisions",
        f"overall: attainment {_fmt(o['attainment'], '.1%')} (TTFT {_fmt(o['ttft_attainment'], '.1%')}, TPOT "
        f"{_fmt(o['tpot_attainment'], '.1%')}), TTFT p90 {_fmt(o['ttft_p90_s'], '.3f')} s, TPOT p90 "
        f"{_fmt(o['tpot_p90_s'], '.4f')} s, {o['gpu_hours']:.2f} GPU-hours, goodput {o['goodput_rps']:.2f} req/s "
        f"({o['goodput_per_gpu_hour']:.0f} per GPU-hour)",
        f"{'window':>8} {'requests':>8} {'attain':>7} {'TTFT p90':>9} {'TPOT p90':>9} {'P':>5} {'D':>5} {'lent':>5}",
    ]
    for w in data["windows"]:
        mean = w["mean_replicas"]
        lines.append(
            f"{w['start_s']:>7.0f}s {w['requests']:>8} {_fmt(w['attainment'], '7.1%')} {_fmt(w['ttft_p90_s'], '8.3f')}s"
            f" {_fmt(w['tpot_p90_s'], '8.4f')}s {_fmt(mean['prefill'], '5.1f')} {_fmt(mean['decode'], '5.1f')}"
            f" {_fmt(mean['lent'], '5.2f')}"
        )
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    """Arrivals per window, replicas per role over time, attainment per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, timeline = data["windows"], data["timeline"]
    width = data["inputs"]["window_s"]
    fig, (arrivals, replicas, attained) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    starts = [w["start_s"] / 60 for w in windows]
    arrivals.bar(starts, [w["requests"] / width for w in windows], width=width / 60, align="edge", color="grey")
    arrivals.set(ylabel="arrivals (req/s)")
    if timeline:
        t = [s["time_s"] / 60 for s in timeline]
        for key, label in (("prefill", "prefill (routed)"), ("decode", "decode"), ("lent", "lent"), ("held", "held")):
            replicas.step(t, [s[key] for s in timeline], where="post", label=label)
        replicas.legend(fontsize=8)
    replicas.set(ylabel="replicas")
    values = [math.nan if w["attainment"] is None else 100 * w["attainment"] for w in windows]
    attained.step([*starts, starts[-1] + width / 60], [*values, values[-1]], where="post")
    attained.axhline(90, color="grey", linestyle="--", linewidth=1)
    attained.set(ylabel="SLO attainment (%)", xlabel="minutes", ylim=(0, 105))
    for ax in (arrivals, replicas, attained):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    try:
        data = run(args)
    except (InputError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(data))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "simulation.json").write_text(json.dumps(data, indent=1) + "\n")
        plot(data, args.out / "timeline.png")
        print(f"wrote {args.out / 'simulation.json'} and {args.out / 'timeline.png'}")
    return 0


def with_defaults(**overrides: Any) -> argparse.Namespace:
    """The namespace the command line gives, every option not in ``overrides`` at its default."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = {action.dest: action.default for action in parser._actions if action.dest != "help"}
    return argparse.Namespace(**(defaults | overrides))
