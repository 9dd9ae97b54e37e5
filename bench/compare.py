"""Goodput of disaggregated against colocated serving: ``python -m bench.compare``.

On one machine, one after another, with the same total cores (2 engine replicas, one
torch thread each), it starts each system as a Serve application in a fresh local Ray
cluster, runs the same rate sweep of each workload on it, and stops it cleanly:

* ``colocated``          2 replicas doing both phases, plain continuous batching;
* ``colocated-chunked``  the same with chunked prefill (token budget 256 per step);
* ``disagg-pull``        1 prefill + 1 decode replica, decode pulls the KV over NIXL;
* ``disagg-push``        the same, prefill pushes each layer's KV as it is computed;
* ``elastic``            1 + 1 pull with the elastic autoscaler on (the default policy, its
                         SLOs set to the workload's: one server per workload).

SLOs are fixed here as multiples of the uncontended latency measured at the start on the
idle colocated system, one request at a time (Splitwise's method): TTFT <= 5x the TTFT of
the workload's median prompt, TPOT <= 2x the uncontended TPOT. Rates are multiples of
``2 / uncontended E2E`` of the median request (two replicas serving one request each).

Three stages: calibrate on the idle colocated system (``calibrate``), run each system
(``run_system``), render (``bench.goodput_report.write_report``, after every sweep). Writes
``docs/benchmarks/goodput.{md,json,png}`` and ``goodput_cdf_<workload>.png``; the
per-request records go to ``--raw`` (not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.goodput_report import (
    TPOT_SLO_X,
    TTFT_SLO_X,
    Calibration,
    CrossCheck,
    Report,
    SystemRun,
    WorkloadCalibration,
    load_previous,
    write_report,
)
from bench.serve import Target, run, sweep, uncontended
from bench.slo import SLO
from workloads import BenchRequest, make_requests, median_request

HTTP_PORT = 18480
METRICS_PORT = 18490
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


# ---- one system ----------------------------------------------------------------------------


class Server:
    """One Serve application in its own local Ray cluster, stopped on exit."""

    def __init__(self, application: str, args: dict[str, str], index: int) -> None:
        """``application``: ``colocated`` (colocated_app) or ``disagg`` (disagg_app)."""
        self.application, self.args, self.index = application, args, index
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
        builder = colocated_app if self.application == "colocated" else disagg_app
        serve.run(builder(dict(self.args)), name="bench", route_prefix="/")
        httpx.get(self.url + "/ready", timeout=60).raise_for_status()
        # Ctrl-C and SIGTERM must end the run (and stop this cluster in __exit__)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        return self

    def model(self) -> str:
        """The model name the application serves."""
        return httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        time.sleep(2)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


# ---- the independent check ---------------------------------------------------------------


def crosscheck(target: Target, requests: list[BenchRequest], num: int = 4) -> tuple[CrossCheck, ...]:
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
            CrossCheck(
                prompt_tokens=request.prompt_tokens,
                max_tokens=request.max_tokens,
                harness_ttft_s=record.ttft,
                openai_ttft_s=first - start,
                harness_e2e_s=record.e2e,
                openai_e2e_s=end - start,
            )
        )
    return tuple(rows)


# ---- the command line ----------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The command line, checked."""

    workloads: tuple[str, ...]
    systems: tuple[str, ...]
    num_requests: int
    seed: int
    multipliers: dict[str, tuple[float, ...]]  # rate points per workload
    out: Path
    raw: Path
    merge: bool


def _parser() -> argparse.ArgumentParser:
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
    return parser


def parse_options(argv: list[str] | None = None) -> Options:
    """The options; exits naming an unknown workload or system."""
    args = _parser().parse_args(argv)
    multipliers = dict(MULTIPLIERS)
    for item in args.multipliers.replace(";", " ").split():
        name, _, values = item.partition("=")
        multipliers[name] = tuple(float(v) for v in values.split(","))
    workloads = tuple(w for w in args.workloads.split(",") if w)
    systems = tuple(s for s in args.systems.split(",") if s)
    for name in workloads:
        if name not in MULTIPLIERS:
            sys.exit(f"unknown workload {name!r}: choose from {', '.join(MULTIPLIERS)}")
    for name in systems:
        if name not in SYSTEMS:
            sys.exit(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    return Options(
        workloads=workloads,
        systems=systems,
        num_requests=args.num_requests,
        seed=args.seed,
        multipliers=multipliers,
        out=Path(args.out),
        raw=Path(args.raw),
        merge=args.merge,
    )


def argv_text(argv: list[str] | None) -> str:
    return "python -m bench.compare" + ("" if not (argv or sys.argv[1:]) else " " + " ".join(argv or sys.argv[1:]))


def workload_requests(options: Options) -> dict[str, list[BenchRequest]]:
    """The same requests for every system: per workload, in the order given."""
    from engine.loader import ModelSpec, load_tokenizer

    tokenizer = load_tokenizer(ModelSpec())
    return {
        w: make_requests(w, tokenizer, MAX_MODEL_LEN, options.num_requests, options.seed) for w in options.workloads
    }


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
        label = f"{system}/{workload}"
        fixed = calibration.workloads[workload]
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

    @property
    def previous_checks(self) -> tuple[CrossCheck, ...]:
        return self.previous.calibration.crosscheck if self.previous else ()

    def report(self, calibration: Calibration, runs: list[SystemRun], model: str) -> Report:
        """The report of the previous workloads and of ``runs`` so far."""
        this_run = {w: {r.system: r.sweeps[w] for r in runs if w in r.sweeps} for w in self.workloads}
        elapsed_s = time.time() - self.started
        if self.previous is None:
            return Report(
                command=self.command, elapsed_s=elapsed_s, model=model, calibration=calibration, results=this_run
            )
        previous = self.previous
        return Report(
            command=f"{previous.command} && {self.command}",
            elapsed_s=previous.elapsed_s + elapsed_s,
            model=model,
            calibration=Calibration(
                workloads={**previous.calibration.workloads, **calibration.workloads},
                crosscheck=calibration.crosscheck,
            ),
            results={**previous.results, **this_run},
        )


# ---- the comparison ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    requests = workload_requests(options)
    previous = load_previous(options.out, options.raw, list(options.workloads)) if options.merge else None
    basis = ReportBasis(command=argv_text(argv), started=time.time(), workloads=options.workloads, previous=previous)
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
                calibration = calibrate(target, requests, options.multipliers, basis.previous_checks)
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
