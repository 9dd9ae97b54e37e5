"""Calibrate the planner's cost model on this machine: ``python -m bench.calibrate_planner``.

Measures the served engine as ``bench.compare`` runs it (the default model, one torch thread
per replica, ``max_model_len`` 512, a 384 MiB KV pool, the app's other engine defaults) and
writes ``planner/calibration/cpu-2core.json`` (``planner.costs.load_calibration`` fits it):

* prefill: one ``EngineCore.step`` over one prompt of 16 to 511 tokens, and over batches of
  2-4 prompts of 512 tokens (what a prefill replica batches up to its 2,048-token budget);
* decode: steps of batches of 1-16 sequences at three prompt lengths (every step timed, with
  its batch's KV tokens);
* mixed steps (decodes and a prompt in one step), recorded to check ``mixed_step_s`` with;
* KV transfer: our NIXL pull between two processes (``bench.kv_transfer.TransferActor``) of
  1 to 64 blocks (a 512-token prompt is 32);
* interference: a batch-8 decode step with the other core idle and beside a process
  prefilling distinct 400-token prompts back to back (as ``bench.elastic``'s floor, whose
  prompt repeats and so hits the prefix cache); the slowdown is the simulator's
  ``SystemSpec.interference``;
* the serving stack (``--stack``, also run by default after the rest): each system of
  ``bench.compare`` the check compares (colocated, disagg-pull) served in its own local Ray
  cluster, one request at a time on the idle app (prompts of ``STACK_LENGTHS`` tokens, 32
  output tokens, medians of 3 after a warm-up): its TTFT against the engine's prefill (and the
  transfer) gives the stack's ``ttft_s`` (intercept) and ``prefill_factor`` (slope), its TPOT
  over the engine's batch-1 step its ``decode_factor``; 2, then 4 requests of 200 tokens sent
  at once (decoded as one batch; second of two rounds): their TPOT over the engine's step at
  that batch its ``batched_decode_factors``; then 24 requests, one every 0.5 s: the CPU
  every process but the engine replicas used (the cluster's and this client's, from
  ``/proc``) per streamed token is its ``cpu_s_per_token`` (``planner.costs.ServingStack``).
  Its prompts are not the check's.

Shapes are measured in two rounds, the second in reverse order, and medians kept: the
machine's speed drifts within minutes (docs/benchmarks/engine.md).

Each engine part runs in a fresh subprocess (one torch thread), as a replica does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from planner.costs import DEFAULT_CALIBRATION, load_calibration, save_calibration

MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 384 << 20
BLOCK_SIZE = 16
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 384, 511)
PREFILL_BATCHES = (2, 3, 4)  # prompts of 512 tokens in one step
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_PROMPTS = (32, 224, 448)
DECODE_STEPS = 8
MIXED = ((4, 128, 128), (4, 128, 384), (8, 224, 256))  # (decodes, their prompt length, new prompt)
TRANSFER_BLOCKS = (1, 4, 16, 32, 64)
REPEATS = 3
ROUNDS = 2
STACK_LENGTHS = (48, 200, 400)
STACK_SYSTEMS = {"colocated": "colocated", "disaggregated": "disagg-pull"}  # kind -> bench.compare system
STACK_OUTPUT = 32
STACK_LOAD = (24, 0.5, 64, 48)  # requests, seconds between them, prompt tokens, output tokens
STACK_BATCHES = (2, 4)  # requests sent at once (each a batched probe)
STACK_BATCH_PROMPT = 200  # their prompt tokens
# the runs repeat the same prompts (and the probe one prompt): a prefix cache would serve them
# from the previous run's KV, which the simulator does not model and fresh traffic does not get
NO_PREFIX_CACHE = {"engine.enable_prefix_caching": "false"}


def _core():
    import torch

    torch.set_num_threads(1)
    from engine.config import EngineConfig
    from engine.core import EngineCore

    # no prefix cache: every measured prompt is computed in full (the served app's prompts
    # share at most a chat template's first block)
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES, block_size=BLOCK_SIZE, enable_prefix_caching=False
    )
    return EngineCore.from_spec(config=config)


class Prompts:
    """Distinct exact-length prompts (no shared prefix block, so the prefix cache never hits)."""

    def __init__(self, tokenizer) -> None:
        from workloads import PromptBuilder

        self.builder, self.number = PromptBuilder(tokenizer), 0

    def request(self, length: int, max_tokens: int):
        from engine.params import GenerationRequest, SamplingParams

        self.number += 1
        prompt = tuple(self.builder.summarization(length, 997 * self.number))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return GenerationRequest(f"cal{self.number}", prompt, sampling)


def _timed_step(core) -> float:
    start = time.perf_counter()
    core.step()
    return time.perf_counter() - start


def _finish(core) -> None:
    while core.has_work():
        core.step()


def measure_prefill(core, prompts: Prompts) -> list[dict]:
    """Median of ``REPEATS`` steps per shape, the shapes run in ``ROUNDS`` rounds (the second
    in reverse order), so a slow spell of the machine hits one repetition, not a whole shape."""
    shapes = [(1, n) for n in PREFILL_LENGTHS] + [(k, 512 - 1) for k in PREFILL_BATCHES]
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    _timed_prefill(core, prompts, 1, 64)  # warm-up
    for number in range(ROUNDS):
        for count, length in shapes if number % 2 == 0 else shapes[::-1]:
            times[(count, length)] += [_timed_prefill(core, prompts, count, length) for _ in range(REPEATS)]
    return [
        {"tokens": count * length, "prompts": count, "seconds": statistics.median(t)}
        for (count, length), t in times.items()
    ]


def _timed_prefill(core, prompts: Prompts, count: int, length: int) -> float:
    for _ in range(count):
        core.add_request(prompts.request(length, 1))
    seconds = _timed_step(core)
    _finish(core)
    return seconds


def _start_batch(core, prompts: Prompts, batch: int, length: int, max_tokens: int) -> None:
    for _ in range(batch):
        core.add_request(prompts.request(length, max_tokens))
    while core.stats().num_queued_prompt_tokens:
        core.step()


def measure_decode(core, prompts: Prompts) -> list[dict]:
    """Per (batch, prompt length) and round: the median of ``DECODE_STEPS`` steps, with the
    batch's KV tokens at the middle step (prompt + tokens so far, per sequence)."""
    shapes = [(batch, length) for length in DECODE_PROMPTS for batch in DECODE_BATCHES]
    points = []
    for number in range(ROUNDS):
        for batch, length in shapes if number % 2 == 0 else shapes[::-1]:
            _start_batch(core, prompts, batch, length, DECODE_STEPS + 4)
            core.step()  # warm-up: the first decode step
            times = [_timed_step(core) for _ in range(DECODE_STEPS)]
            context = batch * (length + 2 + DECODE_STEPS // 2)
            points.append({"batch": batch, "context_tokens": context, "seconds": statistics.median(times)})
            _finish(core)
    return points


def measure_mixed(core, prompts: Prompts) -> list[dict]:
    points = []
    for batch, length, new in MIXED:
        times = []
        for _ in range(REPEATS):
            _start_batch(core, prompts, batch, length, 16)
            core.step()
            core.add_request(prompts.request(new, 1))
            times.append(_timed_step(core))
            _finish(core)
        points.append(
            {
                "batch": batch,
                "context_tokens": batch * (length + 2),
                "prompt_tokens": new,
                "seconds": statistics.median(times),
            }
        )
    return points


def measure_interference(steps: int = 24) -> dict:
    """A batch of 8 decodes (64-token prompts) stepped alone, then while another process
    prefills distinct 400-token prompts back to back, in alternating rounds (medians)."""
    import multiprocessing

    core = _core()
    prompts = Prompts(core.tokenizer)
    from bench import calibrate_planner  # the worker's function by its module name (this runs as __main__)

    ctx = multiprocessing.get_context("spawn")
    busy, stop = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=calibrate_planner.prefill_loop, args=(busy, stop))
    worker.start()
    alone, beside = [], []
    try:
        time.sleep(20)  # the other process loads its model
        _start_batch(core, prompts, 8, 64, 2 * steps * ROUNDS + 8)
        for _ in range(ROUNDS):
            busy.clear()
            time.sleep(1.5)  # its prefill in progress ends
            alone += [_timed_step(core) for _ in range(steps)]
            busy.set()
            time.sleep(0.5)
            beside += [_timed_step(core) for _ in range(steps)]
    finally:
        stop.set()
        busy.set()
        worker.join(60)
    idle_ms, contended_ms = statistics.median(alone) * 1e3, statistics.median(beside) * 1e3
    return {
        "batch": 8,
        "steps": len(alone),
        "decode_step_idle_ms": idle_ms,
        "decode_step_beside_prefill_ms": contended_ms,
    }


def prefill_loop(busy, stop) -> None:
    """The other process: while ``busy`` is set, prefill distinct 400-token prompts."""
    core = _core()
    prompts = Prompts(core.tokenizer)
    while not stop.is_set():
        if busy.wait(0.1) and not stop.is_set():
            _timed_prefill(core, prompts, 1, 400)


def engine_worker() -> dict:
    core = _core()
    prompts = Prompts(core.tokenizer)
    return {
        "prefill": measure_prefill(core, prompts),
        "decode": measure_decode(core, prompts),
        "mixed": measure_mixed(core, prompts),
        "kv_bytes_per_token": core.pool.view().layout.bytes_per_token,
        "kv_capacity_tokens": core.allocator.num_blocks * BLOCK_SIZE,
    }


def measure_transfer() -> list[dict]:
    """Our NIXL pull between two Ray actors (processes), median of ``REPEATS`` after a warm-up."""
    import ray

    from bench.kv_transfer import BYTES_PER_BLOCK, TransferActor, measure
    from bench.ray_local import start_local_ray

    start_local_ray(object_store_memory=1 << 30)
    try:
        producer, consumer = TransferActor.remote("cal-producer"), TransferActor.remote("cal-consumer")
        meta, addresses = ray.get(producer.raw_meta.remote())
        points = []
        for blocks in TRANSFER_BLOCKS:
            times = [
                measure("nixl_pull", producer, consumer, f"{blocks}-{rep}", blocks, meta, addresses)
                for rep in range(REPEATS + 1)
            ][1:]
            points.append({"blocks": blocks, "bytes": blocks * BYTES_PER_BLOCK, "seconds": statistics.median(times)})
    finally:
        ray.shutdown()
    return points


def _subprocess_json(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_stack(data: dict) -> dict:
    """The serving stack's share per system kind (module docstring), against ``data``'s engine fits."""
    from bench.compare import COMMON, SYSTEMS
    from bench.ray_local import Server
    from bench.serve import Target
    from planner.costs import calibrated_cost

    cost = calibrated_cost(data)
    kinds = {}
    for kind, system in STACK_SYSTEMS.items():
        application, extra = SYSTEMS[system]
        with Server(application, {**COMMON, **extra, **NO_PREFIX_CACHE}, index=0) as server:
            kinds[kind] = probe_stack(server.url, Target(server.url, server.model()), cost, kind)
        kinds[kind]["system"] = system
    return {
        "source": "served app, one request at a time: TTFT = ttft_s + prefill_factor x the engine's prefill"
        " (+ transfer), least squares over the prompt lengths; TPOT = decode_factor x the engine's batch-1"
        f" step (median), and at batches of {' and '.join(map(str, STACK_BATCHES))} (as many requests at once)"
        f" x its step at that batch; under load ({STACK_LOAD[0]} requests, one every {STACK_LOAD[1]} s): CPU of every"
        " process of the cluster and the client but the engine replicas, per streamed token",
        "kinds": kinds,
    }


def probe_stack(url: str, target, cost, kind: str) -> dict:
    """One served app's stack (``kind``: ``colocated`` / ``disaggregated``) against ``cost``'s
    engine fits: the idle-app probes, the batched probe, the load run and their fit. The app
    must run with prefix caching off (the probes repeat their prompts)."""
    from bench.compare import MAX_MODEL_LEN as SERVED_LEN
    from bench.serve import uncontended
    from workloads import BenchRequest, PromptBuilder

    builder = PromptBuilder(_tokenizer())
    assert max(STACK_LENGTHS) + STACK_OUTPUT <= SERVED_LEN
    probes = []
    for number, length in enumerate(STACK_LENGTHS):
        prompt = builder.summarization(length, 7919 * (number + 1))
        served = uncontended(target, BenchRequest(prompt, length, STACK_OUTPUT), max_tokens=STACK_OUTPUT)
        probes.append(_stack_probe(cost, kind, length, served))
        print(f"  {kind} {length} tokens: {probes[-1]}", file=sys.stderr, flush=True)
    batched = [_batched_probe(target, cost, builder, batch) for batch in STACK_BATCHES]
    print(f"  {kind} batches: {batched}", file=sys.stderr, flush=True)
    load = _stack_cpu(url, target, builder)
    print(f"  {kind} under load: {load}", file=sys.stderr, flush=True)
    probed = {"cores": os.cpu_count() or 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "probes": probes}
    probed |= {"batched": batched, "load": load}
    return probed | fit_stack(probed)


def _batched_probe(target, cost, builder, batch: int) -> dict:
    """``batch`` requests sent at once (prefilled together, then decoded as one batch): the
    median TPOT of the second of two rounds (the first warms the batch's shapes up)."""
    import asyncio

    from bench.serve import run
    from workloads import BenchRequest

    length = STACK_BATCH_PROMPT
    seeds = [15485863 * (i + 1) for i in range(batch)]
    requests = [BenchRequest(builder.summarization(length, seed), length, STACK_OUTPUT) for seed in seeds]
    for _ in range(2):
        records, _ = asyncio.run(run(target, requests, [0.0] * batch, progress=False))
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"batched probe failed: {bad[0]}")
    tpot = statistics.median(r.tpot for r in records)
    step = cost.decode_step_s(batch, batch * (length + STACK_OUTPUT // 2))
    return {"batch": batch, "prompt_tokens": length, "tpot_s": round(tpot, 6), "engine_step_s": round(step, 6)}


def fit_stack(kind: dict) -> dict:
    """``planner.costs.ServingStack``'s fields from one kind's recorded probes and load run:
    TTFT = hops + factor x engine TTFT (least squares; a factor below 1, i.e. noise, is taken
    as 1 with the hops the median excess), TPOT = factor x engine step (median ratio), and
    per batched probe its TPOT over the engine's step at that batch (never below 1 either)."""
    probes = kind["probes"]
    engine = [p["ttft_s"] - p["ttft_extra_s"] for p in probes]
    served = [p["ttft_s"] for p in probes]
    slope, hops = (float(c) for c in np.polyfit(engine, served, 1)) if len(probes) > 1 else (1.0, 0.0)
    if slope < 1.0:
        slope, hops = 1.0, statistics.median(s - e for s, e in zip(served, engine))
    decode = statistics.median(p["tpot_s"] / (p["tpot_s"] - p["tpot_extra_s"]) for p in probes)
    fitted = {
        "ttft_s": round(max(hops, 0.0), 5),
        "prefill_factor": round(slope, 4),
        "decode_factor": round(max(decode, 1.0), 4),
        "cpu_s_per_token": kind["load"]["cpu_s_per_token"],
    }
    batched = sorted(kind.get("batched", []), key=lambda probe: probe["batch"])
    if batched:
        fitted["batched_decode_factors"] = [
            [probe["batch"], round(max(probe["tpot_s"] / probe["engine_step_s"], 1.0), 4)] for probe in batched
        ]
    return fitted


def cpu_ticks() -> tuple[int, int, float]:
    """(busy ticks of the whole machine, ticks of this process and its descendants: the Ray
    cluster and the replicas it started, the monotonic clock)."""
    busy = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    machine = sum(busy) - busy[3] - busy[4]
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    ours, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        ours += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return machine, ours, time.monotonic()


def _stack_cpu(url: str, target, builder) -> dict:
    """CPU seconds per streamed token of everything but the engine replicas (the proxy, the
    ingress, Serve's controller, Ray's daemons, this client), under a load of distinct
    requests; the engines' pids from ``GET /admin/kv``."""
    import asyncio

    import httpx

    from bench.serve import run
    from workloads import BenchRequest

    count, every, length, output = STACK_LOAD
    engines = [r["pid"] for r in httpx.get(f"{url}/admin/kv", timeout=10).json()["replicas"] if r["live"]]
    requests = [BenchRequest(builder.summarization(length, 104729 * (i + 1)), length, output) for i in range(count)]
    before, engines_before = cpu_ticks(), _ticks(engines)
    records, duration = asyncio.run(run(target, requests, [i * every for i in range(count)], progress=False))
    after, engines_after = cpu_ticks(), _ticks(engines)
    tick = os.sysconf("SC_CLK_TCK")
    stack_s = (after[1] - before[1] - (engines_after - engines_before)) / tick
    tokens = sum(r.usage_output_tokens or len(r.chunks) for r in records if r.ok)
    return {
        "engine_pids": engines,
        "seconds": round(duration, 2),
        "tokens": tokens,
        "engines_cpu_s": round((engines_after - engines_before) / tick, 2),
        "stack_cpu_s": round(stack_s, 2),
        "cpu_s_per_token": round(stack_s / max(tokens, 1), 6),
    }


def _ticks(pids: list[int]) -> int:
    """utime + stime of ``pids`` (clock ticks)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def _stack_probe(cost, kind: str, length: int, served: dict) -> dict:
    engine_ttft = cost.prefill_s(length)
    if kind == "disaggregated":
        engine_ttft += cost.transfer_s(length * cost.kv_bytes_per_token)
    mid_context = length + STACK_OUTPUT // 2
    return {
        "prompt_tokens": length,
        "ttft_s": round(served["ttft_s"], 5),
        "tpot_s": round(served["tpot_s"], 6),
        "ttft_extra_s": round(served["ttft_s"] - engine_ttft, 5),
        "tpot_extra_s": round(served["tpot_s"] - cost.decode_step_s(1, mid_context), 6),
    }


def _tokenizer():
    from engine.loader import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec())


def calibrate(command: str) -> dict:
    from bench.host import machine

    started = time.time()
    print("engine: prefill, decode and mixed steps...", file=sys.stderr, flush=True)
    engine = _subprocess_json(["-m", "bench.calibrate_planner", "--engine-worker"])
    print("interference: a decode batch beside a prefilling process...", file=sys.stderr, flush=True)
    floor = _subprocess_json(["-m", "bench.calibrate_planner", "--interference-worker"])
    print("KV transfer (NIXL pull)...", file=sys.stderr, flush=True)
    transfer = measure_transfer()
    slowdown = floor["decode_step_beside_prefill_ms"] / floor["decode_step_idle_ms"] - 1
    return {
        "command": command,
        "machine": machine(),
        "model": "SmolLM2-135M-Instruct (the default), float32, 1 torch thread per replica",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "elapsed_s": round(time.time() - started, 1),
        "load_average_after": os.getloadavg(),
        "engine": {
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_bytes": KV_CACHE_BYTES,
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": 2048,
            "kv_bytes_per_token": engine["kv_bytes_per_token"],
            "kv_capacity_tokens": engine["kv_capacity_tokens"],
        },
        "prefill": engine["prefill"],
        "decode": engine["decode"],
        "mixed": engine["mixed"],
        "transfer": transfer,
        "interference": {
            "value": round(max(slowdown, 0.0), 4),
            "source": "batch-8 decode step beside a process prefilling distinct 400-token prompts / alone - 1",
            "floor": floor,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.calibrate_planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interference-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stack", action="store_true", help="measure only the serving stack, into --out's file")
    parser.add_argument("--refit-stack", action="store_true", help="refit --out's stack from its recorded probes")
    args = parser.parse_args(argv)
    if args.refit_stack:
        data = json.loads(Path(args.out).read_text())
        for kind in data["stack"]["kinds"].values():
            kind.update(fit_stack(kind))
        save_calibration(data, Path(args.out))
        print(f"refitted {args.out}: {load_calibration(args.out).stacks}", file=sys.stderr)
        return
    if args.engine_worker or args.interference_worker:
        print(json.dumps(engine_worker() if args.engine_worker else measure_interference()))
        return
    command = "python -m bench.calibrate_planner" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    out = Path(args.out)
    data = json.loads(out.read_text()) if args.stack else calibrate(command)
    print("serving stack (through the served app)...", file=sys.stderr, flush=True)
    data["stack"] = {"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **measure_stack(data)}
    path = save_calibration(data, out)
    cost = load_calibration(path)
    print(
        f"wrote {path}: decode {cost.decode}, transfer {cost.transfer}, interference {cost.interference},"
        f" stack {cost.stacks}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
