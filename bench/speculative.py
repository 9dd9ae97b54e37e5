"""Speculative decoding (prompt lookup) on against off: ``python -m bench.speculative``.

The engine in this process on ``workloads.documents``'s texts (edit, summarization, chatbot): decode TPOT at
batch 1 and 16, on and off in alternating rounds, to the end of text and with ``ignore_eos``; acceptance and
tokens per verify step; a batch-size sweep on edit (its crossover sets ``speculative.disable_by_batch_size``).
``--stage served``: goodput through ``disagg_app`` (pull, 1 + 1) on edit prompts, off then on, SLOs as
``bench.compare``'s. Writes ``<out>/speculative.{json,png}`` and ``<out>/speculative.md``'s block."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from bench.engine import greedy_request
from bench.host import engine_core, machine, tokenizer
from bench.report import arguments, cells, command_line, figure, publish, read_json, table
from workloads import BenchRequest, median_request
from workloads.documents import WORKLOADS, messages

NAME = "bench.speculative"
ROUNDS = 2
BATCHES = (1, 16)
SWEEP = (1, 2, 4, 8, 16)
MAX_TOKENS = 256  # up to the end of text (the edit answers copy whole functions)
IGNORE_EOS_TOKENS = 128
ON = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SERVED_TOKENS = 128
SERVED_RATES = (2.0, 3.0, 4.0, 5.0, 6.0)  # multiples of 1 / (uncontended E2E of the median request)
WARM_UP = 8  # short requests at once, twice, before a sweep: the first batched steps build kernels


def prompts(tokenizer, workload: str, count: int) -> list[list[int]]:
    from engine.tokenization import encode_prompt

    return [encode_prompt(tokenizer, messages(workload, i)) for i in range(count)]


def run_batch(core, batch: list[list[int]], ignore_eos: bool) -> dict:
    """All of ``batch`` at once to the end: mean decode TPOT over requests, tokens, acceptance."""
    before, first, last, tokens = dataclasses.astuple(core.spec_counters), {}, {}, {}
    max_tokens = IGNORE_EOS_TOKENS if ignore_eos else MAX_TOKENS
    for i, prompt in enumerate(batch):
        core.add_request(greedy_request(f"r{i}", prompt, max_tokens, ignore_eos))
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.token_ids)
    tpots = [(last[r] - first[r]) / (tokens[r] - 1) for r in tokens if tokens[r] > 1]
    drafts, proposed, accepted = (a - b for a, b in zip(dataclasses.astuple(core.spec_counters), before))
    return {"tpot_s": statistics.mean(tpots), "tokens": sum(tokens.values()), "drafts": drafts,
            "draft_tokens": proposed, "accepted_tokens": accepted}  # fmt: skip


def compare(cores: dict, batch: list[list[int]], ignore_eos: bool, rounds: int) -> dict:
    """On and off in alternating rounds (a warm-up first); per system the median TPOT."""
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    run_batch(cores["off"], batch[:1], ignore_eos)  # warm-up
    for rep in range(rounds):
        for system in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            runs[system].append(run_batch(cores[system], batch, ignore_eos))
    on, off = runs["on"], runs["off"]
    draft_tokens, accepted, drafts = (sum(r[k] for r in on) for k in ("draft_tokens", "accepted_tokens", "drafts"))
    return {"tpot_on_s": statistics.median(r["tpot_s"] for r in on), "tokens_on": on[-1]["tokens"],
            "tpot_off_s": statistics.median(r["tpot_s"] for r in off), "tokens_off": off[-1]["tokens"],
            "acceptance": accepted / draft_tokens if draft_tokens else None,
            "tokens_per_verify": 1 + accepted / drafts if drafts else None}  # fmt: skip


def measure(options: argparse.Namespace) -> dict:
    """Each workload at ``BATCHES``, stopping at the end of text and with ``ignore_eos``; the sweep on edit."""
    common = {"max_model_len": 2048, "kv_cache_bytes": 512 << 20, "max_num_seqs": 64}  # "on" speculates at any batch
    cores = {"on": engine_core(**common, speculative={**ON, "disable_by_batch_size": 64}), "off": engine_core(**common)}
    pools = {w: prompts(cores["on"].tokenizer, w, 16) for w in {*options.workloads, "edit"}}
    shapes = [(w, b, eos) for w in options.workloads for b in BATCHES for eos in (False, True)]
    shapes += [(None, b, True) for b in options.sweep]
    rows, sweep = [], []
    for workload, batch, ignore_eos in shapes:
        pool = pools[workload or "edit"]
        row = compare(cores, [pool[i % len(pool)] for i in range(batch)], ignore_eos, options.rounds)
        head = {"workload": workload, "batch": batch, "ignore_eos": ignore_eos} if workload else {"batch": batch}
        (rows if workload else sweep).append(head | row)
        print(head | row, flush=True)
    return {"command": command_line(NAME), "machine": machine(), "speculative": ON, "rows": rows, "sweep": sweep}


def served(options: argparse.Namespace) -> dict:
    """Goodput without and with speculation through ``disagg_app`` (see the module docstring)."""
    from bench.compare import system_server, without_records, workload_slo
    from bench.serve import Target, run_checked, sweep, uncontended

    requests = [BenchRequest(p, len(p), SERVED_TOKENS) for p in prompts(tokenizer(), "edit", options.num_requests)]
    on = {f"speculative.{k}": str(v) for k, v in ON.items()}
    warm, results, calibration = [BenchRequest(r.prompt, r.prompt_tokens, 16) for r in requests[:WARM_UP]], {}, {}
    for index, (system, extra) in enumerate((("off", {}), ("on", on))):
        with system_server("disagg-pull", index, {"model.max_model_len": "1024", **extra}) as server:
            target = Target(server.url, server.model())
            if not calibration:
                calibration = uncontended(target, median_request(requests), max_tokens=64)
                e2e = calibration["ttft_s"] + (SERVED_TOKENS - 1) * calibration["tpot_s"]
                calibration["rates"] = [round(m / e2e, 4) for m in SERVED_RATES]
            for _ in range(2):
                run_checked(target, warm, "warm-up")
            done = sweep(target, requests, calibration["rates"], workload_slo(calibration), label=system)
            results[system] = without_records(done)
    return {"command": command_line(NAME), "calibration": calibration, "results": results}


def _speedup(row: dict) -> float:
    return row["tpot_off_s"] / row["tpot_on_s"]


def render(data: dict) -> list[str]:
    lines = [f"`{data['command']}` on {data['machine']}; speculative settings {data['speculative']}.", ""]
    row = "{tpot_off_s:ms.1f} | {tpot_on_s:ms.1f} | {x:.2f}x | {acceptance:.2f}"
    head = "TPOT off (ms) | TPOT on (ms) | speed-up | acceptance"
    items = [{**r, "eos": "ignore_eos" if r["ignore_eos"] else "end of text", "x": _speedup(r)} for r in data["rows"]]
    template = f"{{workload}} | {{batch}} | {{eos}} | {row} | {{tokens_per_verify:.2f}}"
    lines += table(f"workload | batch | stops at | {head} | tokens per verify", [cells(template, r) for r in items])
    lines += ["", "Batch-size sweep (edit, `ignore_eos`, speculation at every size):", ""]
    lines += table(f"batch | {head}", [cells(f"{{batch}} | {row}", {**r, "x": _speedup(r)}) for r in data["sweep"]])
    if not (served_data := data.get("served")):
        return lines
    calibration, results = served_data["calibration"], served_data["results"]
    points = len(next(iter(results.values()))["points"])
    lines += ["", f"Served (`{served_data['command']}`): disagg_app, pull, 1 + 1 replicas, edit prompts, "
             f"{SERVED_TOKENS} tokens each with `ignore_eos`, {points} rate points; "
             f"SLO TTFT {5 * calibration['ttft_s']:.2f} s, TPOT {2e3 * calibration['tpot_s']:.0f} ms (5x and 2x the "
             "idle system's without speculation).", ""]  # fmt: skip
    head = ["speculation", *(f"{r:.3g} req/s" for r in calibration["rates"]), "goodput"]
    rows = ([system, *(f"{p['attainment']:.0%} ({1e3 * p['tpot_s']['p90']:.0f} ms)" for p in result["points"]),
             result["goodput"]["text"]] for system, result in results.items())  # fmt: skip
    return lines + table(head, rows) + ["", "(attainment, and TPOT p90 in brackets)"]


def plot(data: dict, path: Path) -> None:
    """TPOT off and on per workload, batch and stop (left); the batch-size sweep's speed-up (right)."""
    rows = data["rows"]
    with figure(path, 1, 2, (11, 3.8), grid=False, legend={"fontsize": 8}) as (bars, sweep_ax, _):
        xs = range(len(rows))
        bars.bar([x - 0.2 for x in xs], [1e3 * r["tpot_off_s"] for r in rows], 0.4, label="off")
        bars.bar([x + 0.2 for x in xs], [1e3 * r["tpot_on_s"] for r in rows], 0.4, label="on")
        labels = [f"{r['workload'][:5]} b{r['batch']}{' ie' if r['ignore_eos'] else ''}" for r in rows]
        bars.set_xticks(list(xs), labels, rotation=60, fontsize=7)
        bars.set(ylabel="decode TPOT (ms)", title="speculation off / on (ie: ignore_eos)")
        sweep_ax.plot([r["batch"] for r in data["sweep"]], [_speedup(r) for r in data["sweep"]], marker="o")
        sweep_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        sweep_ax.set(xscale="log", xlabel="batch (edit, ignore_eos)", ylabel="TPOT speed-up", ylim=(0, None))


def main(argv: list[str] | None = None) -> None:
    parser = arguments(NAME, __doc__, "docs/benchmarks", "folder of speculative.{json,md,png}")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds per comparison")
    parser.add_argument("--sweep", type=int, nargs="*", default=list(SWEEP), help="batch sizes of the sweep")
    parser.add_argument("--stage", choices=("engine", "served", "all", "report"), default="all")
    parser.add_argument("--num-requests", type=int, default=24, help="served: requests per rate point")
    options = parser.parse_args(argv)
    path = options.out / "speculative.json"
    data = read_json(path) if path.exists() else {}
    if options.stage in ("engine", "all"):
        data = {**measure(options), "served": data.get("served")}
    if options.stage in ("served", "all"):
        data["served"] = served(options)
    publish(options.out, "speculative", NAME, data, render(data), "# Speculative decoding (prompt lookup)")
    plot(data, options.out / "speculative.png")


if __name__ == "__main__":
    main()
