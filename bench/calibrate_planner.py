"""Calibrate the planner's cost model on this machine: ``python -m bench.calibrate_planner``.

Measures the served engine as ``bench.compare`` runs it (the default model, one torch thread
per replica, ``max_model_len`` 512, a 384 MiB KV pool, no prefix cache) and writes
``planner/calibration/cpu-2core.json`` (``planner.costs.load_calibration`` fits it):

* prefill: one ``EngineCore.step`` over one prompt of 16 to 511 tokens, and over batches of
  2-4 prompts of 512 tokens (what a prefill replica batches up to its 2,048-token budget);
* decode: steps of batches of 1-16 sequences at three prompt lengths (every step timed, with
  its batch's KV tokens); mixed steps (decodes and a prompt in one step), to check
  ``mixed_step_s`` with;
* KV transfer: our NIXL pull between two processes (``bench.kv_transfer.TransferActor``) of
  1 to 64 blocks (a 512-token prompt is 32);
* interference: ``bench.elastic``'s floor, a batch-8 decode step with the other core idle and
  beside a process prefilling distinct 400-token prompts back to back; the slowdown is the
  simulator's ``SystemSpec.interference``;
* the serving stack (``--stack``, also run by default after the rest; ``probe_stack``): each
  system the check compares (colocated, disagg-pull) served in its own local Ray cluster: one
  request at a time on the idle app (TTFT against the engine's prefill and transfer: the
  stack's ``ttft_s`` and ``prefill_factor``; TPOT over the engine's batch-1 step: its
  ``decode_factor``), 2 then 4 requests at once (``batched_decode_factors``), then a load run
  whose CPU outside the engine replicas per streamed token is its ``cpu_s_per_token``
  (``planner.costs.ServingStack``). Its prompts are not the check's.

Shapes are measured in two rounds, the second in reverse order, and medians kept: the
machine's speed drifts within minutes (docs/benchmarks/engine.md). Each engine part runs in a
fresh subprocess (one torch thread), as a replica does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.host import engine_core, machine, ticks_between, tree_ticks, worker_json
from bench.report import command_line, first_paragraph, read_json
from planner.costs import DEFAULT_CALIBRATION, load_calibration, save_calibration

NAME = "bench.calibrate_planner"
MAX_MODEL_LEN, KV_CACHE_BYTES, BLOCK_SIZE = 512, 384 << 20, 16
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 384, 511)
PREFILL_BATCHES = (2, 3, 4)  # prompts of 512 tokens in one step
DECODE_BATCHES, DECODE_PROMPTS, DECODE_STEPS = (1, 2, 4, 8, 16), (32, 224, 448), 8
MIXED = ((4, 128, 128), (4, 128, 384), (8, 224, 256))  # (decodes, their prompt length, new prompt)
TRANSFER_BLOCKS = (1, 4, 16, 32, 64)
REPEATS, ROUNDS = 3, 2
STACK_LENGTHS = (48, 200, 400)
STACK_SYSTEMS = {"colocated": "colocated", "disaggregated": "disagg-pull"}  # kind -> bench.compare system
STACK_OUTPUT = 32
STACK_LOAD = (24, 0.5, 64, 48)  # requests, seconds between them, prompt tokens, output tokens
STACK_BATCHES, STACK_BATCH_PROMPT = (2, 4), 200  # requests sent at once (each a batched probe), their prompt
# the stack probes (and the check's runs) repeat their prompts: a prefix cache would serve them
# from the previous run's KV, which the simulator does not model and fresh traffic does not get
NO_PREFIX_CACHE = {"engine.enable_prefix_caching": "false"}


def core():
    """The engine as calibrated: every measured prompt computed in full (no prefix cache)."""
    return engine_core(max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES, block_size=BLOCK_SIZE,
                       enable_prefix_caching=False)  # fmt: skip


class Prompts:
    """Distinct exact-length prompts (no shared prefix block, so the prefix cache never hits)."""

    def __init__(self, words) -> None:
        from workloads import PromptBuilder

        self.builder, self.number = PromptBuilder(words), 0

    def request(self, length: int, max_tokens: int):
        from engine.params import GenerationRequest, SamplingParams

        self.number += 1
        prompt = tuple(self.builder.summarization(length, 997 * self.number))
        return GenerationRequest(
            f"cal{self.number}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )


def timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def finish(engine) -> None:
    while engine.has_work():
        engine.step()


def timed_prefill(engine, prompts: Prompts, count: int, length: int) -> float:
    """One step prefilling ``count`` prompts of ``length`` tokens."""
    for _ in range(count):
        engine.add_request(prompts.request(length, 1))
    seconds = timed_step(engine)
    finish(engine)
    return seconds


def start_batch(engine, prompts: Prompts, batch: int, length: int, max_tokens: int) -> None:
    """``batch`` requests admitted and stepped until every prompt is computed."""
    for _ in range(batch):
        engine.add_request(prompts.request(length, max_tokens))
    while engine.stats().num_queued_prompt_tokens:
        engine.step()


def measure_engine() -> dict:
    """Prefill, decode and mixed steps: medians of ``REPEATS`` (prefill, mixed) or of
    ``DECODE_STEPS`` steps (decode, with the batch's KV tokens at the middle step), the shapes
    in ``ROUNDS`` rounds (the second in reverse order), so a slow spell of the machine hits one
    repetition, not a whole shape."""
    engine = core()
    prompts = Prompts(engine.tokenizer)
    shapes = [(1, n) for n in PREFILL_LENGTHS] + [(k, 512 - 1) for k in PREFILL_BATCHES]
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    timed_prefill(engine, prompts, 1, 64)  # warm-up
    for number in range(ROUNDS):
        for count, length in shapes if number % 2 == 0 else shapes[::-1]:
            times[(count, length)] += [timed_prefill(engine, prompts, count, length) for _ in range(REPEATS)]
    batches, decode = [(batch, length) for length in DECODE_PROMPTS for batch in DECODE_BATCHES], []
    for number in range(ROUNDS):
        for batch, length in batches if number % 2 == 0 else batches[::-1]:
            start_batch(engine, prompts, batch, length, DECODE_STEPS + 4)
            engine.step()  # warm-up: the first decode step
            seconds = statistics.median(timed_step(engine) for _ in range(DECODE_STEPS))
            decode.append(
                {"batch": batch, "context_tokens": batch * (length + 2 + DECODE_STEPS // 2), "seconds": seconds}
            )
            finish(engine)
    mixed = []
    for batch, length, new in MIXED:
        steps = []
        for _ in range(REPEATS):
            start_batch(engine, prompts, batch, length, 16)
            engine.step()
            engine.add_request(prompts.request(new, 1))
            steps.append(timed_step(engine))
            finish(engine)
        mixed.append(
            {
                "batch": batch,
                "context_tokens": batch * (length + 2),
                "prompt_tokens": new,
                "seconds": statistics.median(steps),
            }
        )
    prefill = [{"tokens": c * n, "prompts": c, "seconds": statistics.median(t)} for (c, n), t in times.items()]
    layout, capacity = engine.pool.view().layout, engine.allocator.num_blocks * BLOCK_SIZE
    return {"prefill": prefill, "decode": decode, "mixed": mixed, "kv_bytes_per_token": layout.bytes_per_token,
            "kv_capacity_tokens": capacity}  # fmt: skip


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
            args = (producer, consumer)
            times = [
                measure("nixl_pull", *args, f"{blocks}-{rep}", blocks, meta, addresses) for rep in range(REPEATS + 1)
            ]
            points.append(
                {"blocks": blocks, "bytes": blocks * BYTES_PER_BLOCK, "seconds": statistics.median(times[1:])}
            )
    finally:
        ray.shutdown()
    return points


def probe_stack(url: str, target, cost, kind: str) -> dict:
    """One served app's stack (``kind``: ``colocated`` / ``disaggregated``) against ``cost``'s
    engine fits: the idle-app probes, the batched probes, the load run and their fit. The app
    must run with prefix caching off (the probes repeat their prompts)."""
    from bench.compare import MAX_MODEL_LEN as SERVED_LEN
    from bench.host import tokenizer
    from bench.serve import run, uncontended
    from workloads import BenchRequest, PromptBuilder

    builder = PromptBuilder(tokenizer())
    assert max(STACK_LENGTHS) + STACK_OUTPUT <= SERVED_LEN
    probes = []
    for number, length in enumerate(STACK_LENGTHS):  # one at a time: medians of 3 after a warm-up
        prompt = builder.summarization(length, 7919 * (number + 1))
        served = uncontended(target, BenchRequest(prompt, length, STACK_OUTPUT), max_tokens=STACK_OUTPUT)
        engine_ttft = cost.prefill_s(length)
        if kind == "disaggregated":
            engine_ttft += cost.transfer_s(length * cost.kv_bytes_per_token)
        step = cost.decode_step_s(1, length + STACK_OUTPUT // 2)
        probes.append({"prompt_tokens": length, "ttft_s": round(served["ttft_s"], 5),
                       "tpot_s": round(served["tpot_s"], 6), "ttft_extra_s": round(served["ttft_s"] - engine_ttft, 5),
                       "tpot_extra_s": round(served["tpot_s"] - step, 6)})  # fmt: skip
        print(f"  {kind} {length} tokens: {probes[-1]}", file=sys.stderr, flush=True)
    batched = []
    for batch in STACK_BATCHES:  # sent at once, decoded as one batch: the second of two rounds
        length = STACK_BATCH_PROMPT
        requests = [
            BenchRequest(builder.summarization(length, 15485863 * (i + 1)), length, STACK_OUTPUT) for i in range(batch)
        ]
        for _ in range(2):
            records, _ = asyncio.run(run(target, requests, [0.0] * batch, progress=False))
        if bad := [r.error for r in records if not r.ok]:
            raise RuntimeError(f"batched probe failed: {bad[0]}")
        step = cost.decode_step_s(batch, batch * (length + STACK_OUTPUT // 2))
        tpot = statistics.median(r.tpot for r in records)
        batched.append(
            {"batch": batch, "prompt_tokens": length, "tpot_s": round(tpot, 6), "engine_step_s": round(step, 6)}
        )
    print(f"  {kind} batches: {batched}", file=sys.stderr, flush=True)
    load = _stack_cpu(url, target, builder)
    print(f"  {kind} under load: {load}", file=sys.stderr, flush=True)
    probed = {"cores": os.cpu_count() or 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "probes": probes}
    probed |= {"batched": batched, "load": load}
    return probed | fit_stack(probed)


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
    fitted = {"ttft_s": round(max(hops, 0.0), 5), "prefill_factor": round(slope, 4),
              "decode_factor": round(max(decode, 1.0), 4),
              "cpu_s_per_token": kind["load"]["cpu_s_per_token"]}  # fmt: skip
    if batched := sorted(kind.get("batched", []), key=lambda probe: probe["batch"]):
        fitted["batched_decode_factors"] = [
            [p["batch"], round(max(p["tpot_s"] / p["engine_step_s"], 1.0), 4)] for p in batched
        ]
    return fitted


def _stack_cpu(url: str, target, builder) -> dict:
    """CPU seconds per streamed token of everything but the engine replicas (the proxy, the
    ingress, Serve's controller, Ray's daemons, this client), under a load of distinct
    requests; the engines' pids from ``GET /admin/kv``."""
    import httpx

    from bench.serve import run
    from workloads import BenchRequest

    count, every, length, output = STACK_LOAD
    engines = [r["pid"] for r in httpx.get(f"{url}/admin/kv", timeout=10).json()["replicas"] if r["live"]]
    requests = [BenchRequest(builder.summarization(length, 104729 * (i + 1)), length, output) for i in range(count)]
    before = tree_ticks()
    records, duration = asyncio.run(run(target, requests, [i * every for i in range(count)], progress=False))
    used, tick = tree_ticks(), os.sysconf("SC_CLK_TCK")
    engine_s = ticks_between({p: before.get(p, 0) for p in engines}, {p: used.get(p, 0) for p in engines}) / tick
    stack_s = ticks_between(before, used) / tick - engine_s
    tokens = sum(r.usage_output_tokens or len(r.chunks) for r in records if r.ok)
    return {"engine_pids": engines, "seconds": round(duration, 2), "tokens": tokens,
            "engines_cpu_s": round(engine_s, 2), "stack_cpu_s": round(stack_s, 2),
            "cpu_s_per_token": round(stack_s / max(tokens, 1), 6)}  # fmt: skip


def measure_stack(data: dict) -> dict:
    """The serving stack's share per system kind (module docstring), against ``data``'s engine fits."""
    from bench.compare import COMMON, SYSTEMS
    from bench.ray_local import Server
    from bench.serve import Target
    from planner.costs import calibrated_cost

    cost, kinds = calibrated_cost(data), {}
    for kind, system in STACK_SYSTEMS.items():
        application, extra = SYSTEMS[system]
        with Server(application, {**COMMON, **extra, **NO_PREFIX_CACHE}, index=0) as server:
            kinds[kind] = probe_stack(server.url, Target(server.url, server.model()), cost, kind) | {"system": system}
    source = (
        "served app, one request at a time: TTFT = ttft_s + prefill_factor x the engine's prefill (+ transfer), least "
        "squares over the prompt lengths; TPOT = decode_factor x the engine's batch-1 step (median), and at batches of "
        f"{' and '.join(map(str, STACK_BATCHES))} (as many requests at once) x its step at that batch; under load "
        f"({STACK_LOAD[0]} requests, one every {STACK_LOAD[1]} s): CPU of every process of the cluster and the client "
        "but the engine replicas, per streamed token"
    )
    return {"source": source, "kinds": kinds}


def calibrate(command: str) -> dict:
    started = time.time()
    print("engine: prefill, decode and mixed steps...", file=sys.stderr, flush=True)
    engine = worker_json(NAME, "--engine-worker")
    print("interference: a decode batch beside a prefilling process...", file=sys.stderr, flush=True)
    floor = worker_json(NAME, "--interference-worker")
    print("KV transfer (NIXL pull)...", file=sys.stderr, flush=True)
    transfer = measure_transfer()
    slowdown = floor["decode_step_with_prefill_ms"] / floor["decode_step_idle_ms"] - 1
    settings = {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES, "block_size": BLOCK_SIZE,
                "max_num_batched_tokens": 2048}  # fmt: skip
    return {
        "command": command,
        "machine": machine(),
        "model": "SmolLM2-135M-Instruct (the default), float32, 1 torch thread per replica",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "elapsed_s": round(time.time() - started, 1),
        "load_average_after": os.getloadavg(),
        "engine": settings | {k: engine[k] for k in ("kv_bytes_per_token", "kv_capacity_tokens")},
        **{k: engine[k] for k in ("prefill", "decode", "mixed")},
        "transfer": transfer,
        "interference": {
            "value": round(max(slowdown, 0.0), 4),
            "source": "batch-8 decode step beside a process prefilling distinct 400-token prompts / alone - 1",
            "floor": floor,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=NAME, description=first_paragraph(__doc__))
    parser.add_argument("--out", default=str(DEFAULT_CALIBRATION))
    parser.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interference-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stack", action="store_true", help="measure only the serving stack, into --out's file")
    parser.add_argument("--refit-stack", action="store_true", help="refit --out's stack from its recorded probes")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.refit_stack:
        data = read_json(out)
        for kind in data["stack"]["kinds"].values():
            kind.update(fit_stack(kind))
        save_calibration(data, out)
        print(f"refitted {out}: {load_calibration(out).stacks}", file=sys.stderr)
        return
    if args.engine_worker or args.interference_worker:
        from bench.elastic import engine_floor

        print(json.dumps(measure_engine() if args.engine_worker else engine_floor(48, rounds=ROUNDS, distinct=True)))
        return
    command = command_line(NAME, argv)
    data = read_json(out) if args.stack else calibrate(command)
    print("serving stack (through the served app)...", file=sys.stderr, flush=True)
    data["stack"] = {"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **measure_stack(data)}
    path = save_calibration(data, out)
    cost = load_calibration(path)
    text = f"decode {cost.decode}, transfer {cost.transfer}, interference {cost.interference}, stack {cost.stacks}"
    print(f"wrote {path}: {text}", file=sys.stderr)


if __name__ == "__main__":
    main()
