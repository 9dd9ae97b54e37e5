"""``python -m planner plan``: size prefill and decode pools for a model, GPU, SLOs and rate;
``python -m planner simulate``: what a system and its policy do on a trace (``planner.replay``).

    python -m planner plan --model /models/Llama-3.1-8B-Instruct --gpu h100 \\
        --slo-ttft 0.4 --slo-tpot 0.05 --rate 50 --workload chatbot [--max-gpus N] [--top 5] \\
        [--out DIR] [--colocated]

Prints the best configurations (predicted SLO attainment at the rate, TTFT / TPOT p90, GPUs,
goodput per GPU) and, with ``--out``, writes ``appconfig.yaml`` and ``rayservice-snippet.yaml``
for the best configuration the engine can serve (each pool's TP degree one the model splits by,
``prefill.tensor_parallel_size`` / ``decode.tensor_parallel_size`` written). See docs/planner.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from planner import replay
from planner.plan import Candidate, Plan, PlanRequest, app_config, plan, rayservice_snippet
from planner.roofline import load_hardware, model_shape
from workloads import WORKLOADS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="search P:D ratio, replicas and TP per phase")
    p.add_argument("--model", required=True, help="a Hugging Face config.json or the model directory holding it")
    p.add_argument("--gpu", required=True, help="h100, h200, a100, l40s, or a hardware YAML file")
    p.add_argument("--slo-ttft", type=float, required=True, help="time-to-first-token objective, seconds")
    p.add_argument("--slo-tpot", type=float, required=True, help="time-per-output-token objective, seconds")
    p.add_argument("--rate", type=float, help="requests per second to serve (or give --max-gpus alone)")
    p.add_argument("--workload", default="chatbot", choices=WORKLOADS)
    p.add_argument("--max-gpus", type=int, help="GPU budget; alone: the most goodput it allows")
    p.add_argument("--max-model-len", type=int, help="context served (default: the model's, at most 8192)")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests within both SLOs")
    p.add_argument("--top", type=int, default=5, help="configurations to print")
    p.add_argument("--out", type=Path, help="write appconfig.yaml and rayservice-snippet.yaml here")
    p.add_argument("--colocated", action="store_true", help="also rank colocated replicas (both phases)")
    p.add_argument(
        "--colocated-scheduler",
        choices=("mixed", "prefill-first"),
        default="mixed",
        help="colocated steps: this engine's (mixed) or vLLM 0.2's prefill-first (a reference, not servable)",
    )
    p.add_argument("--seed", type=int, default=0)
    simulate = commands.add_parser("simulate", help="replay a trace through a system and its autoscaling policy")
    replay.add_arguments(simulate)
    return parser


def _request(args: argparse.Namespace) -> PlanRequest:
    shape = model_shape(args.model)
    return PlanRequest(
        shape=shape,
        hardware=load_hardware(args.gpu),
        workload=args.workload,
        ttft_slo_s=args.slo_ttft,
        tpot_slo_s=args.slo_tpot,
        rate=args.rate,
        max_gpus=args.max_gpus,
        max_model_len=args.max_model_len or min(shape.max_position_embeddings, 8192),
        target=args.attainment,
        colocated=args.colocated or args.colocated_scheduler != "mixed",
        colocated_scheduler=args.colocated_scheduler,
        seed=args.seed,
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(result: Plan, top: int) -> str:
    """The ``top`` configurations, one line each."""
    head = f"{'#':>2} {'configuration':<34} {'GPUs':>5} {'goodput/GPU':>11} {'rate':>8} {'attain':>6}"
    head += f" {'TTFT p90':>9} {'TPOT p90':>9}  servable"
    lines = [head]
    for i, c in enumerate(result.ranked[:top], 1):
        servable = "yes" if c.servable else f"no: {c.unservable}"
        servable = "reference (vLLM 0.2 steps)" if c.prefill_first else servable
        lines.append(
            f"{i:>2} {c.label:<34} {c.num_gpus:>5} {c.goodput_per_gpu:>11.3f} {_fmt(c.simulated_rate, '8.2f')}"
            f" {_fmt(c.attainment, '6.1%')} {_fmt(c.ttft_p90_s, '8.3f')}s {_fmt(c.tpot_p90_s, '8.4f')}s  {servable}"
        )
    return "\n".join(lines)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (``serveConfigV2``) as ``|`` blocks, as in deploy/kuberay/."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def write(result: Plan, best: Candidate, out: Path, model_source: str) -> list[Path]:
    """``appconfig.yaml`` (for ``serve run ... config=appconfig.yaml``) and the RayService snippet."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "appconfig.yaml"
    config.write_text(yaml.dump(app_config(result, best, model_source), Dumper=_Dumper, sort_keys=False))
    snippet = out / "rayservice-snippet.yaml"
    header = f"# {best.label}: paste into deploy/kuberay/rayservice.yaml (spec.serveConfigV2, workerGroupSpecs)\n"
    body = yaml.dump(rayservice_snippet(result, best, model_source), Dumper=_Dumper, sort_keys=False)
    snippet.write_text(header + body)
    return [config, snippet]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "simulate":
        return replay.main(args)
    request = _request(args)
    started = time.perf_counter()
    result = plan(request, finalists=max(args.top, 3))
    elapsed = time.perf_counter() - started
    goal = f"{request.rate:g} req/s" if request.rate is not None else f"{request.max_gpus} GPUs"
    print(
        f"{request.shape.name or args.model} on {request.hardware.name}, {request.workload}, {goal}, SLO "
        f"TTFT {request.ttft_slo_s:g}s TPOT {request.tpot_slo_s:g}s at {request.target:.0%}"
    )
    print(table(result, args.top))
    print(f"planned in {elapsed:.1f}s ({len(result.ranked)} configurations, {len(result.phases)} per-replica goodputs)")
    best = result.best_servable()
    if best is None:
        refused = next((c.unservable for c in result.ranked if c.unservable), None)
        print("no servable configuration" + (f": {refused}" if refused else ""))
    else:
        print(f"best servable: {best.label} ({best.num_gpus} GPUs)")
    if args.out is not None and best is not None:
        model_dir = Path(args.model)
        source = str(model_dir.parent if model_dir.name == "config.json" else model_dir)
        for path in write(result, best, args.out, source):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
