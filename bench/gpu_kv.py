"""KV over NIXL on GPU memory, two processes on one GPU, no Ray:
``python3 -m bench.gpu_kv [--out PATH] [--cpu]``.

One markdown table row per measurement (and JSON at ``--out``):

* raw NIXL READ VRAM -> VRAM of 16, 64 and 256 MB (one contiguous descriptor; an agent
  made as ``NixlWorker`` makes its own, UCX backend) against our ``NixlTransport`` pull of
  the same bytes in the pool layout (32 layers x K/V: 64 descriptors). Target: pull / raw
  >= 0.9. Also the raw READ split into as many descriptors as our pull's, none of our code
  around it: what the layout's descriptors cost by themselves;
* push: 32 layers pushed one by one, each right after a simulated forward of known
  duration (a GPU sleep on the compute stream, then ``push_layer``, which records the
  layer's event there). Tail = the last layer's compute end -> the completion notice at the
  consumer, against one layer's transfer (median write done - posted). Target: tail <= 2x
  one layer. Also the tail to the last write's completion, and the last layers' timestamps;
* the same pull and push through pinned host staging (``transport.staging=host``: each
  process's second transport, over the same pool): staged pull GB/s beside the unstaged pull
  and the raw READ of the same size, and the staged push's tail (its completion waits for the
  consumer's copy into the pool too);
* which UCX transports carried the data (``UCX_PROTO_INFO=y`` in the two processes).

The two processes (``bench.gpu_kv_side``) are spawned, never forked (CUDA), and find each
other through a registry in a ``multiprocessing.Manager`` dict. Every row has its own
timeout: a hung transfer kills both processes, its row reads "failed: ...", and the next
row starts a fresh pair. ``--cpu``: the same code on CPU pools (DRAM) and small sizes, the
dry run for a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_kv_side import CONSUMER, PRODUCER, Plan, PushRun, child_main
from bench.report import cells, table
from engine.kv_pool import KVLayout

ROLES = (PRODUCER, CONSUMER)
_UCX_TABLE = re.compile(r"^\[[\d.]+\] \[[^]]*\]\s+[|+]")  # a line of a UCX_PROTO_INFO table
GPU_PLAN = Plan(
    "cuda",
    # an 8B-class model's KV (32 layers, 8 KV heads of 128, bfloat16): 2 MB per 16-token block
    KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"),
    # 256 MB is left out: on the last run its READ went over TCP (0.4 GB/s) and outlived the lease
    sizes_mb=(16, 64),
    num_repeats=12,
    push_blocks=128,  # a 2,048-token prompt: 8 MB per layer
    num_push_repeats=5,
    compute_ms=1.0,  # about one layer of such a prefill on one GPU
    start_timeout_s=45.0,
    row_timeout_s=20.0,
    budget_s=60.0,  # the GPU check gives this section 75 s (closing and the manager take a few)
    staging_sizes_mb=(16, 64),
    num_staged_repeats=5,
    staging_bytes=768 << 20,  # 6 exports of 64 MB at once, or a push's 256 MB on each side
)
CPU_LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
CPU_PLAN = Plan("cpu", CPU_LAYOUT, (1, 4), 8, 16, 3, 2.0, 30.0, 10.0, 50.0, staging_sizes_mb=(1, 4))
CPU_PLAN = dataclasses.replace(CPU_PLAN, num_staged_repeats=3, staging_bytes=64 << 20)


class _Pair:
    """The producer and consumer processes: started on first use, killed after a failed row."""

    def __init__(self, plan: Plan, entries, log_dir: Path) -> None:
        self.plan = plan
        self.entries = entries
        self.log_dir = log_dir
        self.num_starts = 0
        self._procs: dict[str, multiprocessing.Process] = {}
        self._conns: dict = {}

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def log_path(self, role: str, start: int) -> Path:
        return self.log_dir / f"{role}-{start}.log"

    def ensure_started(self, deadline: float) -> None:
        if self._procs:
            return
        ctx = multiprocessing.get_context("spawn")
        self.num_starts += 1
        for role in ROLES:
            ours, theirs = ctx.Pipe()
            log = str(self.log_path(role, self.num_starts))
            proc = ctx.Process(
                target=child_main, args=(role, self.plan, self.entries, theirs, log), name=role, daemon=True
            )
            proc.start()
            theirs.close()
            self._procs[role], self._conns[role] = proc, ours
        for role in ROLES:
            self.recv(role, deadline)  # each answers once its pool and transport are up

    def send(self, role: str, command: str, *args: object) -> None:
        self._conns[role].send((command, args))

    def recv(self, role: str, deadline: float) -> object:
        conn = self._conns[role]
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"no answer from the {role} within the row's time")
        try:
            status, value = conn.recv()
        except EOFError:
            self._procs[role].join(1)
            raise RuntimeError(f"the {role} process died (exit code {self._procs[role].exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"{role}: {value}")
        return value

    def call(self, role: str, command: str, *args: object, deadline: float) -> object:
        self.send(role, command, *args)
        return self.recv(role, deadline)

    def kill(self) -> None:
        for proc in self._procs.values():
            proc.kill()
        for proc in self._procs.values():
            proc.join(5)
        self._procs.clear()
        self._conns.clear()

    def close(self) -> None:
        """Close both transports (memory deregistered, registry left), then end the processes."""
        deadline = time.monotonic() + 5
        for role in list(self._conns):
            with contextlib.suppress(Exception):
                self.call(role, "close", deadline=deadline)
        self.kill()

    def log_tails(self, num_lines: int = 8) -> str:
        """The last lines each process logged, without UCX's protocol tables."""
        lines = []
        for role in ROLES:
            path = self.log_path(role, self.num_starts)
            if path.exists():
                logged = [line for line in path.read_text(errors="replace").splitlines() if not _UCX_TABLE.match(line)]
                lines += [f"  [{role}] {line}" for line in logged[-num_lines:]]
        return "\n".join(lines)


def bandwidth_row(pair: _Pair, size_mb: int, deadline: float, staging: str = "none") -> dict:
    """Raw READ and our pull of ``size_mb`` MB, taking turns, medians after one warm-up each
    (``staging="host"``: our staged pull alone)."""
    plan = pair.plan
    pair.ensure_started(deadline)
    num_blocks = plan.blocks_for(size_mb)
    num_bytes = num_blocks * plan.layout.bytes_per_block
    count = (plan.num_repeats if staging == "none" else plan.num_staged_repeats) + 1
    tag = f"pull{size_mb}-{staging}"
    handles = pair.call(PRODUCER, "export", num_blocks, count, tag, staging, deadline=deadline)
    raw_peer = pair.call(PRODUCER, "raw_meta", deadline=deadline)
    num_pieces = 2 * plan.layout.num_layers  # our pull's descriptors: one run per layer and K/V
    result = pair.call(CONSUMER, "bandwidth", handles, raw_peer, num_bytes, num_pieces, staging, deadline=deadline)
    pull_s = statistics.median(result.pull_s[1:])
    if staging != "none":
        return {
            "size_mb": num_bytes / 2**20,
            "num_blocks": num_blocks,
            "num_descriptors": result.num_descriptors,
            "pull_us": pull_s * 1e6,
            "pull_gb_per_s": num_bytes / pull_s / 1e9,
            "bytes_ok": result.bytes_ok,
        }
    raw_s, split_s = (statistics.median(t[1:]) for t in (result.raw_s, result.raw_split_s))
    return {
        "size_mb": num_bytes / 2**20,
        "num_blocks": num_blocks,
        "num_descriptors": result.num_descriptors,
        "raw_us": raw_s * 1e6,
        "raw_split_us": split_s * 1e6,
        "pull_us": pull_s * 1e6,
        "raw_gb_per_s": num_bytes / raw_s / 1e9,
        "raw_split_gb_per_s": num_bytes / split_s / 1e9,
        "pull_gb_per_s": num_bytes / pull_s / 1e9,
        "pull_vs_raw": raw_s / pull_s,
        "pull_vs_raw_split": split_s / pull_s,
        "bytes_ok": result.bytes_ok,
    }


def push_row(pair: _Pair, deadline: float, staging: str = "none") -> dict:
    """Pushes of ``plan.push_blocks`` blocks, layer by layer; medians after one warm-up, which
    also checks the bytes that arrived."""
    plan = pair.plan
    pair.ensure_started(deadline)
    figures = []
    for rep in range(plan.num_push_repeats + 1):
        tag = f"push-{staging}-{rep}"
        dest = pair.call(CONSUMER, "destination", tag, plan.push_blocks, staging, deadline=deadline)
        pair.send(CONSUMER, "wait_push", dest, rep == 0, staging)  # waits while the producer pushes
        run = pair.call(PRODUCER, "push", dest, staging, deadline=deadline)
        notice_at, bytes_ok = pair.recv(CONSUMER, deadline)
        figures.append(push_figures(run, notice_at) | {"bytes_ok": bytes_ok})
    timed = figures[1:]
    medians = {k: statistics.median(f[k] for f in timed) for k, v in timed[0].items() if isinstance(v, float)}
    return figures[-1] | medians | {"bytes_ok": figures[0]["bytes_ok"], "num_layers": plan.layout.num_layers}


def push_figures(run: PushRun, notice_at: float) -> dict:
    """One push's figures in ms, from one clock (both processes' unix time on one machine)."""
    times, ends = run.layer_times, run.compute_end
    last_end = ends[-1]
    one_layer = max(statistics.median(t.done - t.posted for t in times), 1e-9)
    to_notice = notice_at - last_end
    to_last_write = max(t.done for t in times) - last_end

    def ms(seconds: float) -> float:
        return round(seconds * 1e3, 3)

    return {
        "layer_bytes": run.num_bytes // len(times),
        "one_layer_ms": one_layer * 1e3,
        "tail_to_notice_ms": to_notice * 1e3,
        "tail_to_last_write_ms": to_last_write * 1e3,
        "tail_in_layers": to_notice / one_layer,
        "last_write_in_layers": to_last_write / one_layer,
        "compute_per_layer_ms": statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e3,
        "posted_after_compute_ms": statistics.median(t.posted - e for t, e in zip(times, ends)) * 1e3,
        "call_before_compute_end_ms": statistics.median(e - t.compute_end for t, e in zip(times, ends)) * 1e3,
        "last_layers": [
            {
                "layer": t.layer,
                "compute_end_ms": ms(e - last_end),
                "push_layer_called_ms": ms(t.compute_end - last_end),
                "posted_ms": ms(t.posted - last_end),
                "done_ms": ms(t.done - last_end),
            }
            for t, e in zip(times[-3:], ends[-3:])
        ],
    }


_RANGE = re.compile(r"^\d[\dKMGT]*(\.\.(\d[\dKMGT]*|inf))?$")  # "0", "1..16515", "8K..inf"


def ucx_transports(log_dir: Path) -> list[str]:
    """The UCX protocols chosen for remote memory access (READ: ucp_get, WRITE: ucp_put),
    from the ``UCX_PROTO_INFO`` tables in the two processes' logs, GPU memory first:
    ``<operation>: <protocol> via <transport/device>``. A table is (each line after UCX's
    time and process prefix; older UCX puts the context and the operation on one line)::

        | <context> intra-node cfg#1                                       |
        | remote memory read by ucp_get*(multi) into host memory from host |
        | Range  | Description |              Config                       |
        | 0..inf | zero-copy   | cma/memory                                |
    """
    found: list[str] = []
    for path in sorted(log_dir.glob("*.log")):
        operation = None
        for line in path.read_text(errors="replace").splitlines():
            cells = [c.strip() for c in line.partition("|")[2].split("|")]
            cells = [c for c in cells if c]
            titles = [c for c in cells if c.startswith("remote memory")]
            if titles:
                operation = titles[0]
            elif 0 < len(cells) <= 2:  # the title of another table (or the context's line)
                operation = None
            elif operation and len(cells) == 3 and _RANGE.match(cells[0]):
                entry = f"{operation}: {cells[1]} via {cells[2]}"
                if entry not in found:
                    found.append(entry)
    return sorted(found, key=lambda entry: "cuda" not in entry)


def _guarded(pair: _Pair, budget_deadline: float, measure: Callable[[float], dict]) -> dict:
    """One row: ``measure(deadline)`` within the row's time. Any failure, a hung transfer
    included, is the row's result and kills the pair, so the next row starts fresh."""
    plan = pair.plan
    remaining = budget_deadline - time.monotonic()
    if remaining < 1:
        return {"error": "skipped: out of time"}
    limit = plan.row_timeout_s + (0 if pair.started else plan.start_timeout_s)
    try:
        return measure(time.monotonic() + min(limit, remaining))
    except Exception as exc:
        print(f"row failed: {type(exc).__name__}: {exc}\n{pair.log_tails()}", file=sys.stderr, flush=True)
        pair.kill()
        return {"error": f"failed: {type(exc).__name__}: {exc}".replace("|", "/")}


BANDWIDTH = (
    "size (MB) | blocks | our descriptors | raw READ (GB/s) | raw READ, as many descriptors (GB/s) | our pull (GB/s)"
    " | pull / raw (>= 0.9) | pull / raw as many | bytes ok",
    "{size_mb:.1f} | {num_blocks} | {num_descriptors} | {raw_gb_per_s:.1f} | {raw_split_gb_per_s:.1f}"
    " | {pull_gb_per_s:.1f} | {pull_vs_raw:.2f} | {pull_vs_raw_split:.2f} | {ok}",
)
STAGED = (
    "size (MB) | staged pull (GB/s) | unstaged pull (GB/s) | raw READ (GB/s) | staged / unstaged | bytes ok",
    "{size_mb:.1f} | {pull_gb_per_s:.2f} | {plain:.2f} | {raw:.2f} | {ratio:.2f} | {ok}",
)
PUSH = (
    "forward per layer, measured (ms) | one layer's write (ms) | tail to notice (ms) | tail / one layer (<= 2)"
    " | tail to last write (ms) | last write / one layer | bytes ok",
    "{compute_per_layer_ms:.3f} | {one_layer_ms:.3f} | {tail_to_notice_ms:.3f} | {tail_in_layers:.2f}"
    " | {tail_to_last_write_ms:.3f} | {last_write_in_layers:.2f} | {ok}",
)
LAYER = "{layer} | {compute_end_ms:.3f} | {push_layer_called_ms:.3f} | {posted_ms:.3f} | {done_ms:.3f}"


def _print(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


def _line(template: str, row: dict, size_mb: int | None = None) -> str:
    """One printed row: its cells, or the failure (a row of its own)."""
    if "error" in row:
        return f"| {row['error']} |" if size_mb is None else f"| {size_mb} | {row['error']} |"
    return f"| {cells(template, row | {'ok': 'yes' if row['bytes_ok'] else 'NO'}, missing='')} |"


def run_rows(pair: _Pair) -> dict:
    """The pull against the raw READ per size, the push, then the same through host staging."""
    plan = pair.plan
    budget_deadline = time.monotonic() + plan.budget_s
    kind = f"{plan.mem_type} -> {plan.mem_type}"
    _print(f"## KV over NIXL, {kind}, two processes ({plan.device}), {plan.layout.num_layers} layers x K/V")
    _print(*table(BANDWIDTH[0], []))
    rows = []
    for size_mb in plan.sizes_mb:
        row = _guarded(pair, budget_deadline, functools.partial(bandwidth_row, pair, size_mb))
        rows.append({"requested_mb": size_mb} | row)
        _print(_line(BANDWIDTH[1], row, size_mb))
    push = _guarded(pair, budget_deadline, functools.partial(push_row, pair))
    _print(*_push_lines(plan, push))
    _print("", f"## through pinned host staging (transport.staging=host), {plan.num_staged_repeats} pulls per size")
    _print(*table(STAGED[0], []))
    by_size, staged = {row["requested_mb"]: row for row in rows}, []
    for size_mb in plan.staging_sizes_mb:
        row = _guarded(pair, budget_deadline, functools.partial(bandwidth_row, pair, size_mb, staging="host"))
        staged.append({"requested_mb": size_mb} | row)
        plain, raw = by_size.get(size_mb, {}).get("pull_gb_per_s"), by_size.get(size_mb, {}).get("raw_gb_per_s")
        ratio = row["pull_gb_per_s"] / plain if plain and "error" not in row else None
        _print(_line(STAGED[1], row | {"plain": plain, "raw": raw, "ratio": ratio}, size_mb))
    staged_push = _guarded(pair, budget_deadline, functools.partial(push_row, pair, staging="host"))
    _print(*_push_lines(plan, staged_push, "staged push (its notice waits for the copy into the pool)")[:5])
    return {"pull_vs_raw": rows, "push": push, "staged_pull": staged, "staged_push": staged_push}


def _push_lines(plan: Plan, push: dict, title: str = "push") -> list[str]:
    layer_mb = plan.push_blocks * plan.layout.bytes_per_block / plan.layout.num_layers / 2**20
    lines = [
        "",
        f"## {title}: {plan.layout.num_layers} layers x {layer_mb:.1f} MB, simulated forward {plan.compute_ms:.2f} ms "
        f"per layer; medians of {plan.num_push_repeats} after one warm-up",
        *table(PUSH[0], [_line(PUSH[1], push)[2:-2]]),
    ]
    if "error" in push:
        return lines
    posted, called = push["posted_after_compute_ms"], -push["call_before_compute_end_ms"]
    median = f"median of all layers | 0 | {called:.3f} | {posted:.3f} | {posted + push['one_layer_ms']:.3f}"
    return lines + [
        "",
        "Last layers of the last push, ms from the last layer's compute end (compute end: the layer's",
        "event on the GPU; push_layer called: the host call, LayerTiming.compute_end):",
        *table(
            "layer | compute end | push_layer called | posted | done",
            [*(cells(LAYER, t) for t in push["last_layers"]), median],
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.gpu_kv", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--cpu", action="store_true", help="CPU pools (DRAM) and small sizes: a dry run")
    args = parser.parse_args(argv)
    plan = CPU_PLAN if args.cpu else GPU_PLAN
    result: dict = {"plan": dataclasses.asdict(plan)}
    if plan.device == "cuda" and not torch.cuda.is_available():
        _print("| gpu_kv | skipped: no CUDA (use --cpu for the dry run) |")
        result["skipped"] = "no CUDA"
    else:
        os.environ.setdefault("UCX_PROTO_INFO", "y")  # read by UCX in the two processes
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, tempfile.TemporaryDirectory(prefix="gpu_kv_") as log_dir:
            pair = _Pair(plan, manager.dict(), Path(log_dir))
            try:
                result |= run_rows(pair)
            finally:
                pair.close()
            result["ucx_transports"] = ucx_transports(Path(log_dir))
        found = [f"| {entry.replace('|', '/')} |" for entry in result["ucx_transports"][:8]]
        _print("", "| UCX protocol (UCX_PROTO_INFO) |", "|---|")
        _print(*(found or ["| not reported: no protocol tables in the two processes' logs |"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
