"""Tensor parallelism on this CPU: ``python -m bench.tensor_parallel``.

``--stage decode``: a decode step of the default model at TP 1 and TP 3 (local ranks, one torch thread each), batch 1
and 16, and the share of rank 0's step in all-reduces. ``--stage transfer``: one request's KV (16 and 64 MB of an
8B-class layout) read and written over NIXL between two agents of this process: whole blocks, re-sharded 1 -> 2 (a
descriptor per token), and heads-major (a descriptor per block). Writes ``<out>/tensor_parallel.{json,png}`` and
``<out>/tensor_parallel.md``'s block (a stage keeps the other's results)."""

from __future__ import annotations

import multiprocessing
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.engine import greedy_request, prefilled
from bench.host import engine_core, machine, seconds
from bench.report import arguments, cells, command_line, figure, publish, read_json, table
from engine.kv_pool import KVLayout
from engine.tensor_parallel import RankGroup, leader
from kv_transport.descriptors import PoolGeometry, head_rows
from kv_transport.nixl_transport import NixlTransport
from kv_transport.registry import LocalPeerRegistry

NAME = "bench.tensor_parallel"
BATCHES = (1, 16)
STEPS = 40
SIZES_MB = (16, 64)
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
REPEATS = 5


def decode_steps(degree: int, batch: int) -> dict:
    """Median decode step (s) of ``batch`` sequences, and rank 0's share of it in all-reduces."""
    core = engine_core(tensor_parallel_size=degree, max_model_len=512, kv_cache_bytes=64 << 20)
    try:
        prefilled(core, [greedy_request(f"r{i}", range(100 + i, 132 + i), STEPS + 8) for i in range(batch)], warm=3)
        times, reduce = [], []
        for _ in range(STEPS):
            before = core.tp.group.reduce_s if core.tp else 0.0
            times.append(seconds(core.step))
            reduce.append((core.tp.group.reduce_s if core.tp else 0.0) - before)
        core.abort_all()
    finally:
        core.close()
    return {"degree": degree, "batch": batch, "step_s": statistics.median(times), "reduce_s": statistics.median(reduce)}


def _probe_rank(rank: int, rendezvous, width: int, rounds: int) -> None:
    """One rank of the all-reduce probe: ``rounds`` sums of a ``[width]`` float32 tensor."""
    torch.set_num_threads(1)
    group, tensor = RankGroup(rank, rendezvous, torch.device("cpu")), torch.ones(width)
    for _ in range(rounds):
        group.all_reduce(tensor)


def all_reduce_alone(batch: int, degree: int = 3, rounds: int = 300) -> float:
    """Seconds per all-reduce of a decode step's ``[batch, hidden]`` among ``degree`` processes doing
    nothing else: the sum and its messages without the wait for another rank's compute."""
    context = multiprocessing.get_context("spawn")
    rendezvous, join = leader(degree, torch.device("cpu"))
    width = batch * 576  # the default model's hidden size
    procs = [context.Process(target=_probe_rank, args=(r, rendezvous, width, rounds)) for r in range(1, degree)]
    for proc in procs:
        proc.start()
    group, tensor = join(), torch.ones(width)
    for _ in range(rounds):
        group.all_reduce(tensor)
    for proc in procs:
        proc.join()
    return group.reduce_s / rounds


def _rows(base: int, blocks: int, pool_blocks: int, heads: int, first: int | None, count: int, per_block: bool):
    """Rows for ``blocks`` consecutive blocks from block 0: coalesced (one per layer and K/V),
    one per block, or one per token (``first`` heads of ``heads``)."""
    head_bytes = HEAD_DIM * 4
    if first is not None or per_block:
        return head_rows(base, LAYERS, pool_blocks, BLOCK, heads, head_bytes, 0, range(blocks), first, count)
    geometry = PoolGeometry(base, LAYERS, pool_blocks, BLOCK * heads * head_bytes, 0)  # the transport's own rows
    return np.asarray(geometry.descs([(0, blocks)]), dtype=np.int64)


def _time(op: str, initiator, peer, local, remote) -> float:
    """One READ (the consumer pulls) or WRITE (the producer pushes), posted as the transport does."""
    start = time.perf_counter()
    if op == "READ":
        done = initiator._worker.read_inline(local, remote, peer.agent_name, "bench", "DRAM", "bench")
        if not isinstance(done, tuple):
            done.result(60)
    else:
        initiator._post("WRITE", local, remote, peer, "bench").result(60)
    return time.perf_counter() - start


def transfer_case(size_mb: int) -> list[dict]:
    """Each way of moving one request's KV of ``size_mb`` (or a rank's half of it), median of reads."""
    blocks = size_mb * 2**20 // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 4 * BLOCK)
    results = []
    for name, heads, first, per_block in (
        ("same degree (whole blocks)", KV_HEADS, None, False),
        ("re-sharded 1 -> 2, token rows", KV_HEADS, 0, False),
        ("heads-major 1 -> 2, block rows", KV_HEADS // 2, None, True),
    ):
        registry, pool_blocks = LocalPeerRegistry(), blocks + 1
        layout = KVLayout(LAYERS, heads, HEAD_DIM, BLOCK, "float32")
        pools = [torch.ones(LAYERS, 2, pool_blocks, BLOCK, heads, HEAD_DIM) for _ in range(2)]
        sides = [NixlTransport(f"tp-bench-{i}", layout, registry) for i in range(2)]
        for side, pool in zip(sides, pools):
            side.register_pool(pool, lambda rid: None)
        try:
            count = KV_HEADS // 2 if first is not None else heads
            rows = [_rows(pool.data_ptr(), blocks, pool_blocks, heads, first, count, per_block) for pool in pools]
            for op, (initiator, other) in (("READ", (1, 0)), ("WRITE", (0, 1))):
                peer = sides[initiator]._peer(sides[other].engine_id, sides[other].incarnation, "bench")
                args = (op, sides[initiator], peer, rows[initiator], rows[other])
                seconds = statistics.median(_time(*args) for _ in range(REPEATS))
                num_bytes = int(rows[0][:, 1].sum())
                row = {"size_mb": size_mb, "case": name, "op": op, "descriptors": len(rows[0]), "bytes": num_bytes}
                results.append({**row, "seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9})
        finally:
            for side in sides:
                side.close()
    return results


def render(data: dict) -> list[str]:
    lines = [f"Measured with `{data['command']}` on {data['machine']}.", ""]
    decode = {(r["degree"], r["batch"]): r for r in data.get("decode", [])}
    if decode:
        rows = []
        template = "{batch} | {one:ms.1f} ms | {step_s:ms.1f} ms | {ratio:.2f}x | {reduce_s:ms.1f} ms ({share:.0%})"
        template += " | {all_reduce_alone_s:ms.2f} ms | {all_reduce_two_ranks_s:ms.2f} ms"
        for batch in BATCHES:
            one, three = decode[(1, batch)]["step_s"], decode[(3, batch)]
            item = {"one": one, "ratio": three["step_s"] / one, "share": three["reduce_s"] / three["step_s"]}
            rows.append(cells(template, three | item))
        header = "batch | TP 1 step | TP 3 step | TP 3 / TP 1 | TP 3 rank 0 in its 60 all-reduces"
        header += " | one all-reduce alone, 3 ranks | one all-reduce alone, 2 ranks"
        lines += ["### Decode step, default model", "", *table(header, rows), ""]
    if data.get("transfer"):
        row = "{size_mb} MB | {case} | {op} | {descriptors} | {bytes:MB.1f} MB | {seconds:ms.2f} ms | {gb_per_s:.2f}"
        rows = [cells(row, r) for r in data["transfer"]]
        header = "request KV | transfer | NIXL op (pull: READ, push: WRITE) | descriptors | bytes | time | GB/s"
        lines += ["### KV into one consumer rank", "", *table(header, rows)]
    return lines


def plot(data: dict, path: Path) -> None:
    with figure(path, 1, 2, (10, 3.6), grid=False) as (step_ax, read_ax, _):
        for degree in (1, 3):
            points = [r for r in data.get("decode", []) if r["degree"] == degree]
            step_ax.bar([f"b{r['batch']} TP{degree}" for r in points], [1e3 * r["step_s"] for r in points])
        step_ax.set(ylabel="decode step (ms)", title="decode step, default model")
        for row in data.get("transfer", []):
            case = row["case"].split(",")[0].split(" (")[0]
            read_ax.bar(f"{row['size_mb']}MB {row['op']}\n{case}", row["gb_per_s"])
        read_ax.set(ylabel="GB/s", title="KV into one rank")
        read_ax.tick_params(axis="x", labelsize=6)


def main() -> None:
    parser = arguments(NAME, __doc__, "docs/benchmarks", help="folder of the JSON, PNG and page")
    parser.add_argument("--stage", choices=("decode", "transfer", "all", "report"), default="all")
    args = parser.parse_args()
    path = args.out / "tensor_parallel.json"
    data = read_json(path) if path.exists() else {}
    if args.stage != "report":
        data.update(command=command_line(NAME), machine=machine())
    if args.stage in ("decode", "all"):
        data["decode"] = [decode_steps(degree, batch) for batch in BATCHES for degree in (1, 3)]
        for row in data["decode"]:  # at TP 3: one all-reduce alone among 3 and 2 ranks
            row["all_reduce_alone_s"] = all_reduce_alone(row["batch"]) if row["degree"] == 3 else None
            row["all_reduce_two_ranks_s"] = all_reduce_alone(row["batch"], degree=2) if row["degree"] == 3 else None
    if args.stage in ("transfer", "all"):
        data["transfer"] = [row for size in SIZES_MB for row in transfer_case(size)]
    plot(data, args.out / "tensor_parallel.png")
    publish(args.out, "tensor_parallel", NAME, data, render(data), "# Tensor parallelism on one CPU machine")


if __name__ == "__main__":
    main()
