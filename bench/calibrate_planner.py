"""Calibrate the planner's cost model on this machine: ``python -m bench.calibrate_planner``.

The engine as ``bench.compare`` serves it (default model, one torch thread, context 512, no prefix cache) into
``planner/calibration/cpu-2core.json``: prefill and decode steps in a fresh process (two rounds, the second
reversed: the machine drifts), our NIXL pull, a decode step beside a prefilling process, each system's stack."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

import httpx
import numpy as np

from bench.engine import drain, greedy_request, prefilled
from bench.host import engine_core, machine, medians, seconds, ticks_between, tokenizer, tree_ticks, worker_json
from bench.report import arguments, command_line, read_json
from bench.serve import Target, run, run_checked, uncontended
from planner.costs import DEFAULT_CALIBRATION, calibrated_cost, load_calibration, save_calibration
from workloads import BenchRequest, PromptBuilder

NAME = "bench.calibrate_planner"
MAX_MODEL_LEN, KV_CACHE_BYTES, BLOCK_SIZE = 512, 384 << 20, 16
PREFILL_LENGTHS = (16, 32, 64, 128, 256, 384, 511)
PREFILL_BATCHES = (2, 3, 4)  # prompts of 512 tokens in one step
DECODE_BATCHES, DECODE_PROMPTS, DECODE_STEPS = (1, 2, 4, 8, 16), (32, 224, 448), 8
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


def core(prefix_caching: bool = False):
    return engine_core(max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES, block_size=BLOCK_SIZE,
                       enable_prefix_caching=prefix_caching)  # fmt: skip


class Prompts:
    """Distinct exact-length prompts (no shared prefix block, so the prefix cache never hits)."""

    def __init__(self, words) -> None:
        self.builder, self.number = PromptBuilder(words), 0

    def request(self, length: int, max_tokens: int):
        self.number += 1
        prompt = self.builder.summarization(length, 997 * self.number)
        return greedy_request(f"cal{self.number}", prompt, max_tokens)


def timed_prefill(engine, prompts: Prompts, count: int, length: int) -> float:
    """One step prefilling ``count`` prompts of ``length`` tokens (then every request is finished)."""
    for _ in range(count):
        engine.add_request(prompts.request(length, 1))
    step_s = seconds(engine.step)
    drain(engine)
    return step_s


def timed_decode(engine, prompts: Prompts, batch: int, length: int, steps: int = DECODE_STEPS) -> float:
    """Median of ``steps`` decode steps of ``batch`` prompts of ``length``, after a warm-up step."""
    prefilled(engine, [prompts.request(length, steps + 4) for _ in range(batch)], warm=1)  # the batch's shapes
    step_s = statistics.median(seconds(engine.step) for _ in range(steps))
    drain(engine)
    return step_s


def in_rounds(shapes: list, once) -> dict:
    """``once(shape)`` per shape in ``ROUNDS`` rounds, alternate ones reversed (a slow spell hits all)."""
    found: dict = {shape: [] for shape in shapes}
    for number in range(ROUNDS):
        for shape in shapes if number % 2 == 0 else shapes[::-1]:
            found[shape].append(once(shape))
    return found


def measure_engine() -> dict:
    """Prefill and decode steps (the decode's KV tokens at its middle step)."""
    engine = core()
    prompts = Prompts(engine.tokenizer)
    timed_prefill(engine, prompts, 1, 64)  # warm-up
    shapes = [(1, n) for n in PREFILL_LENGTHS] + [(k, 512 - 1) for k in PREFILL_BATCHES]
    prefill = in_rounds(shapes, lambda shape: [timed_prefill(engine, prompts, *shape) for _ in range(REPEATS)])
    batches = [(b, n) for n in DECODE_PROMPTS for b in DECODE_BATCHES]
    decode = in_rounds(batches, lambda shape: timed_decode(engine, prompts, *shape))
    layout, capacity = engine.pool.view().layout, engine.allocator.num_blocks * BLOCK_SIZE
    return {"prefill": [{"tokens": c * n, "prompts": c, "seconds": statistics.median(sum(t, []))}
                        for (c, n), t in prefill.items()],
            "decode": [{"batch": b, "context_tokens": b * (n + 2 + DECODE_STEPS // 2), "seconds": s}
                       for (b, n), times in decode.items() for s in times],
            "kv_bytes_per_token": layout.bytes_per_token, "kv_capacity_tokens": capacity}  # fmt: skip


def probe_stack(target, cost, kind: str) -> dict:
    """One served app's stack (``kind``) against ``cost``'s engine fits: one request at a time per length, per batch
    that many at once (the second of two rounds), a load run, and their fit; the app must run without a prefix cache."""
    assert max(STACK_LENGTHS) + STACK_OUTPUT <= MAX_MODEL_LEN  # bench.compare serves the same context
    builder = PromptBuilder(tokenizer())

    def requests(length: int, output: int, seeds) -> list[BenchRequest]:
        return [BenchRequest(builder.summarization(length, seed), length, output) for seed in seeds]

    probes, batched, length = [], [], STACK_BATCH_PROMPT
    for number, size in enumerate(STACK_LENGTHS):
        served = uncontended(target, requests(size, STACK_OUTPUT, [7919 * (number + 1)])[0], max_tokens=STACK_OUTPUT)
        transfer_s = cost.transfer_s(size * cost.kv_bytes_per_token) if kind == "disaggregated" else 0.0
        ttft, tpot, step = served["ttft_s"], served["tpot_s"], cost.decode_step_s(1, size + STACK_OUTPUT // 2)
        probes.append({"prompt_tokens": size, "ttft_s": round(ttft, 5), "tpot_s": round(tpot, 6),
                       "ttft_extra_s": round(ttft - cost.prefill_s(size) - transfer_s, 5),
                       "tpot_extra_s": round(tpot - step, 6)})  # fmt: skip
    for batch in STACK_BATCHES:
        sent = requests(length, STACK_OUTPUT, [15485863 * (i + 1) for i in range(batch)])
        records = [run_checked(target, sent, "batched probe") for _ in range(2)][-1]
        step = cost.decode_step_s(batch, batch * (length + STACK_OUTPUT // 2))
        tpot = statistics.median(r.tpot for r in records)
        batched.append({"batch": batch, "prompt_tokens": length, "tpot_s": round(tpot, 6),
                        "engine_step_s": round(step, 6)})  # fmt: skip
    probed = {"cores": os.cpu_count() or 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "probes": probes,
              "batched": batched, "load": _stack_cpu(target, requests)}  # fmt: skip
    print(f"  {kind}: {probed}", file=sys.stderr, flush=True)
    return probed | fit_stack(probed)


def fit_stack(kind: dict) -> dict:
    """``planner.costs.ServingStack``'s fields from one kind's probes and load run: TTFT = hops + factor x engine TTFT
    (least squares; a factor below 1, noise, is taken as 1 with the hops the median excess), TPOT = factor x engine step
    (median ratio), and per batched probe its TPOT over the engine's step at that batch (never below 1 either)."""
    probes = kind["probes"]
    engine, served = [p["ttft_s"] - p["ttft_extra_s"] for p in probes], [p["ttft_s"] for p in probes]
    slope, hops = (float(c) for c in np.polyfit(engine, served, 1)) if len(probes) > 1 else (1.0, 0.0)
    if slope < 1.0:
        slope, hops = 1.0, statistics.median(s - e for s, e in zip(served, engine))
    decode = statistics.median(p["tpot_s"] / (p["tpot_s"] - p["tpot_extra_s"]) for p in probes)
    fitted = {"ttft_s": round(max(hops, 0.0), 5), "prefill_factor": round(slope, 4),
              "decode_factor": round(max(decode, 1.0), 4),
              "cpu_s_per_token": kind["load"]["cpu_s_per_token"]}  # fmt: skip
    if batched := sorted(kind.get("batched", []), key=lambda probe: probe["batch"]):
        factors = [[p["batch"], round(max(p["tpot_s"] / p["engine_step_s"], 1.0), 4)] for p in batched]
        fitted["batched_decode_factors"] = factors
    return fitted


def _stack_cpu(target, requests) -> dict:
    """CPU seconds per streamed token of all but the engine replicas, under a load of distinct requests."""
    count, every, length, output = STACK_LOAD
    engines = [r["pid"] for r in httpx.get(f"{target.url}/admin/kv", timeout=10).json()["replicas"] if r["live"]]
    sent = requests(length, output, [104729 * (i + 1) for i in range(count)])
    before = tree_ticks()
    records, duration = asyncio.run(run(target, sent, [i * every for i in range(count)], progress=False))
    used, tick = tree_ticks(), os.sysconf("SC_CLK_TCK")
    engine_s = ticks_between({p: before.get(p, 0) for p in engines}, {p: used.get(p, 0) for p in engines}) / tick
    stack_s = ticks_between(before, used) / tick - engine_s
    tokens = sum(r.output_tokens for r in records if r.ok)
    return {"engine_pids": engines, "seconds": round(duration, 2), "tokens": tokens,
            "engines_cpu_s": round(engine_s, 2), "stack_cpu_s": round(stack_s, 2),
            "cpu_s_per_token": round(stack_s / max(tokens, 1), 6)}  # fmt: skip


def calibrate(command: str) -> dict:
    """Engine steps and a decode batch beside a prefilling process (each in a fresh process), then our NIXL pull
    between two Ray actors (medians of ``REPEATS`` after a warm-up)."""
    from app.local_cluster import start_local_ray, stop_local_ray
    from bench.kv_transfer import BYTES_PER_BLOCK, TransferActor, measure

    started = time.time()
    print("engine steps, a decode batch beside a prefilling process, NIXL pull...", file=sys.stderr, flush=True)
    engine, floor = worker_json(NAME, "measure_engine"), worker_json("bench.elastic", "engine_floor", 48, ROUNDS, True)
    start_local_ray(object_store_memory=1 << 30)
    try:
        producer, consumer = TransferActor.remote("cal-producer"), TransferActor.remote("cal-consumer")
        pull = lambda blocks, rep: measure("nixl_pull", producer, consumer, f"{blocks}-{rep}", blocks)  # noqa: E731
        found = medians(TRANSFER_BLOCKS, REPEATS, pull)
    finally:
        stop_local_ray()
    transfer = [{"blocks": b, "bytes": b * BYTES_PER_BLOCK, "seconds": s} for b, s in found.items()]
    slowdown = floor["decode_step_with_prefill_ms"] / floor["decode_step_idle_ms"] - 1
    source = "batch-8 decode step beside a process prefilling distinct 400-token prompts / alone - 1"
    return {"command": command, "machine": machine(),
            "model": "SmolLM2-135M-Instruct (the default), float32, 1 torch thread per replica",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": round(time.time() - started, 1),
            "load_average_after": os.getloadavg(),
            "engine": {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES, "block_size": BLOCK_SIZE,
                       "max_num_batched_tokens": 2048, "kv_bytes_per_token": engine["kv_bytes_per_token"],
                       "kv_capacity_tokens": engine["kv_capacity_tokens"]},
            "prefill": engine["prefill"], "decode": engine["decode"], "transfer": transfer,
            "interference": {"value": round(max(slowdown, 0.0), 4), "source": source, "floor": floor}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = arguments(NAME, __doc__, DEFAULT_CALIBRATION, "the calibration file")
    parser.add_argument("--stack", action="store_true", help="measure only the serving stack, into --out's file")
    parser.add_argument("--refit-stack", action="store_true", help="refit --out's stack from its recorded probes")
    args = parser.parse_args(argv)
    command = command_line(NAME, argv)
    data = read_json(args.out) if args.stack or args.refit_stack else calibrate(command)
    if args.refit_stack:
        for kind in data["stack"]["kinds"].values():
            kind.update(fit_stack(kind))
    else:  # the serving stack's share per system kind, against the engine fits
        from bench.compare import system_server

        print("serving stack (through the served app)...", file=sys.stderr, flush=True)
        cost, kinds = calibrated_cost(data), {}
        for kind, system in STACK_SYSTEMS.items():
            with system_server(system, 0, NO_PREFIX_CACHE) as server:
                kinds[kind] = probe_stack(Target(server.url, server.model()), cost, kind) | {"system": system}
        source = (f"served app, one request at a time, then {' and '.join(map(str, STACK_BATCHES))} at once, then "
                  f"{STACK_LOAD[0]} requests one every {STACK_LOAD[1]} s: {NAME}.probe_stack")  # fmt: skip
        data["stack"] = {"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "source": source,
                         "kinds": kinds}  # fmt: skip
    cost = load_calibration(save_calibration(data, args.out))
    text = f"decode {cost.decode}, transfer {cost.transfer}, interference {cost.interference}, stack {cost.stacks}"
    print(f"wrote {args.out}: {text}", file=sys.stderr)


if __name__ == "__main__":
    main()
