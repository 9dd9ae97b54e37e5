"""KV transfer benchmark: ``python -m bench.kv_transfer`` (summary in docs/benchmarks/kv_transfer.md).

Part 1, bytes/s between two processes (two Ray actors, each with a KV pool of the default
model's layout), for 1, 16, 64 and 256 MB of real KV blocks, buffers touched before
timing, median of several repetitions:
  * our NIXL pull (``fetch``: descriptors, one READ, completion seen by the progress thread);
  * our NIXL push (30 layers' writes posted, then all completions);
  * the object store (copy out + ``ray.put`` in the producer, ``ray.get`` + copy in);
  * raw NIXL: one READ of one contiguous buffer of the same size, no handles or registry,
    completion polled in a tight loop, on memory allocated as the pool is (2 MB pages,
    ``engine/host_memory.py``), and the same on ordinary 4 KB pages (``MADV_NOHUGEPAGE``);
  * a torch copy of the same bytes inside one process, all threads.
Part 2, pipelined push on a 2,048-token prompt (real prefill of the default model): from
the per-layer timestamps, (last layer's KV complete at decode) - (prefill compute end),
against one layer's transfer time; the same for push without pipelining and for pull.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import ray
import torch

from bench.ray_local import start_local_ray
from bench.report import cells, command_line, figure, first_paragraph, table, template, write_json, write_page

SIZES_MB = (1, 16, 64, 256)
REPEATS = 21
PIPELINE_REPEATS = 5
BYTES_PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # default model, float32, 16-token blocks
POOL_BLOCKS = 420  # > 256 MB of blocks


@ray.remote(num_cpus=0.5)
class TransferActor:
    """A pool and a transport, without a model: moves real-layout KV blocks."""

    def __init__(self, engine_id: str) -> None:
        torch.set_num_threads(1)
        from engine.host_memory import host_tensor
        from engine.kv_pool import KVLayout
        from kv_transport.nixl_transport import NixlTransport
        from kv_transport.object_store import ObjectStoreTransport
        from kv_transport.registry import RayPeerRegistry

        self.layout = KVLayout(dtype="float32", num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
        self.pool = host_tensor((30, 2, POOL_BLOCKS, 16, 3, 64), torch.float32).uniform_()  # as the engine's pool
        self.released: list[str] = []
        # pull and push each on their own transport (own NIXL agents), as a deployment runs
        # one mode: when one connection carries pushes one way, UCX completes each READ the
        # other way only after a round trip with the peer (docs/architecture.md)
        self.nixl = NixlTransport(engine_id, self.layout, RayPeerRegistry())
        self.nixl.register_pool(self.pool, self.released.append)
        self.nixl_push = NixlTransport(f"{engine_id}-push", self.layout, RayPeerRegistry())
        self.nixl_push.register_pool(self.pool, self.released.append)
        self.store = ObjectStoreTransport(engine_id, self.layout)
        self.store.register_pool(self.pool, self.released.append)
        from nixl._api import nixl_agent, nixl_agent_config

        # as our transport's agents: no spinning progress thread; the reader's tight poll and,
        # on the side being read, a 1 ms poll (as our transport's) progress UCX
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.raw_agent = nixl_agent(f"raw-{engine_id}", config)
        # 256 MB contiguous: on memory allocated as the pool is, and on ordinary pages
        pool_pages = host_tensor((256 << 18,), torch.float32).uniform_()
        small_pages = host_tensor((256 << 18,), torch.float32, huge_pages=False).uniform_()
        self.raw = {"pool_pages": pool_pages, "4k_pages": small_pages}
        for buffer in self.raw.values():
            self.raw_agent.register_memory(buffer)
        self.raw_lock = threading.Lock()  # the agent is used from two threads
        threading.Thread(target=self._progress_raw, daemon=True).start()

    def _progress_raw(self) -> None:
        while True:
            with self.raw_lock:
                self.raw_agent.get_new_notifs()
            time.sleep(0.001)

    def raw_meta(self) -> tuple[bytes, dict[str, int]]:
        return self.raw_agent.get_agent_metadata(), {pages: t.data_ptr() for pages, t in self.raw.items()}

    def raw_read_s(self, meta: bytes, pages: str, remote_address: int, num_bytes: int, num_descs: int = 1) -> float:
        """One READ of ``num_bytes`` as ``num_descs`` equal pieces spread over the ``pages`` buffer."""
        import numpy as np

        with self.raw_lock:
            name = self.raw_agent.add_remote_agent(meta)
        piece, stride = num_bytes // num_descs, (256 << 20) // num_descs
        offsets = [i * stride for i in range(num_descs)]
        local_rows = np.array([[self.raw[pages].data_ptr() + o, piece, 0] for o in offsets], dtype=np.uint64)
        remote_rows = np.array([[remote_address + o, piece, 0] for o in offsets], dtype=np.uint64)
        local = self.raw_agent.get_xfer_descs(local_rows, "DRAM")
        remote = self.raw_agent.get_xfer_descs(remote_rows, "DRAM")
        start = time.perf_counter()
        with self.raw_lock:
            handle = self.raw_agent.initialize_xfer("READ", local, remote, name)
            state = self.raw_agent.transfer(handle)
            while state == "PROC":
                state = self.raw_agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        with self.raw_lock:
            self.raw_agent.release_xfer_handle(handle)
        assert state == "DONE", state
        return elapsed

    def export(self, transport_name: str, request_id: str, num_blocks: int):
        transport = self.nixl if transport_name == "nixl" else self.store
        start = time.perf_counter()
        handle = transport.export(request_id, list(range(num_blocks)), num_blocks * 16, 1)
        return handle, time.perf_counter() - start

    async def fetch_s(self, transport_name: str, handle) -> float:
        transport = self.nixl if transport_name == "nixl" else self.store
        blocks = list(range(POOL_BLOCKS - handle_blocks(handle), POOL_BLOCKS))  # the caller's input
        start = time.perf_counter()
        await transport.fetch(handle, blocks)
        return time.perf_counter() - start

    def destination(self, request_id: str, num_blocks: int):
        return self.nixl_push.destination(request_id, list(range(num_blocks)), num_blocks * 16)

    async def push_s(self, destination) -> float:
        blocks = list(range(POOL_BLOCKS - len(destination.block_ids), POOL_BLOCKS))
        self.nixl_push.begin_push(destination)
        start = time.perf_counter()
        for layer in range(30):
            self.nixl_push.push_layer(destination.request_id, layer, blocks, 0)
        await self.nixl_push.finish_push(destination.request_id, 1)
        return time.perf_counter() - start

    async def wait_push(self, destination) -> None:
        await self.nixl_push.wait_push(destination)


def handle_blocks(handle) -> int:
    return sum(count for _, count in handle.block_ranges)


def torch_copy_gbps(num_bytes: int) -> float:
    torch.set_num_threads(os.cpu_count() or 1)
    src = torch.rand(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


METHODS = ["nixl_pull", "nixl_push", "object_store", "raw_nixl", "raw_nixl_60_descs", "raw_nixl_4k_pages"]


def measure(
    method: str, producer, consumer, tag: str, num_blocks: int, meta: bytes, addresses: dict[str, int]
) -> float:
    """Seconds of one transfer of ``num_blocks`` blocks' bytes by ``method``."""
    if method == "nixl_pull":
        handle, _ = ray.get(producer.export.remote("nixl", f"pull-{tag}", num_blocks))
        return ray.get(consumer.fetch_s.remote("nixl", handle))
    if method == "nixl_push":
        dest = ray.get(consumer.destination.remote(f"push-{tag}", num_blocks))
        waiting = consumer.wait_push.remote(dest)
        seconds = ray.get(producer.push_s.remote(dest))
        ray.get(waiting)
        return seconds
    if method == "object_store":
        handle, export_s = ray.get(producer.export.remote("store", f"store-{tag}", num_blocks))
        return export_s + ray.get(consumer.fetch_s.remote("store", handle))
    num_descs = 60 if method == "raw_nixl_60_descs" else 1
    pages = "4k_pages" if method == "raw_nixl_4k_pages" else "pool_pages"
    return ray.get(consumer.raw_read_s.remote(meta, pages, addresses[pages], num_blocks * BYTES_PER_BLOCK, num_descs))


def descriptor_cost_us(producer, consumer) -> dict[str, float]:
    """The fixed cost of a descriptor, none of our code: one raw READ of 60 x 64 B against one
    of 64 B (medians, ``initialize_xfer`` included). Per descriptor NIXL prepares it and UCX,
    between CPU memories, reads it with its own ``process_vm_readv`` call; a pull in the pool
    layout (>= 60 descriptors) pays that for 59 more than one contiguous READ."""
    meta, addresses = ray.get(producer.raw_meta.remote())
    times: dict[int, list[float]] = {1: [], 60: []}
    for rep in range(REPEATS + 1):
        for num_descs in (1, 60) if rep % 2 else (60, 1):
            args = (meta, "pool_pages", addresses["pool_pages"], 64 * num_descs, num_descs)
            times[num_descs].append(ray.get(consumer.raw_read_s.remote(*args)))
    one, sixty = (statistics.median(times[n][1:]) * 1e6 for n in (1, 60))
    return {"one_descriptor_us": one, "sixty_descriptors_us": sixty, "per_extra_descriptor_us": (sixty - one) / 59}


def bandwidth_table(producer, consumer) -> list[dict[str, float]]:
    rows = []
    meta, addresses = ray.get(producer.raw_meta.remote())
    for size_mb in SIZES_MB:
        num_blocks = max(1, round(size_mb * 2**20 / BYTES_PER_BLOCK))
        num_bytes = num_blocks * BYTES_PER_BLOCK
        times: dict[str, list[float]] = {method: [] for method in METHODS}
        for rep in range(REPEATS + 1):  # the first repetition warms up
            # each repetition starts with another method: none is always first after the others
            for method in METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]:
                times[method].append(
                    measure(method, producer, consumer, f"{size_mb}-{rep}", num_blocks, meta, addresses)
                )
        gbps = {method: num_bytes / statistics.median(t[1:]) / 1e9 for method, t in times.items()}
        rows.append(
            {
                "size_mb": num_bytes / 2**20,
                "num_blocks": num_blocks,
                **gbps,
                "torch_copy": torch_copy_gbps(num_bytes),
                "pull_vs_raw": gbps["nixl_pull"] / gbps["raw_nixl"],
            }
        )
        print(f"  {size_mb} MB done", file=sys.stderr, flush=True)
    return rows


def pipelining(prompt_len: int = 2048) -> dict[str, float]:
    from bench.engine import corpus_ids
    from bench.engine_actor import EngineActor
    from engine.loader import ModelSpec, load_model
    from engine.params import GenerationRequest, SamplingParams

    prompt = corpus_ids(load_model(ModelSpec()).tokenizer, prompt_len)
    # every repetition prefills (and pushes) the whole prompt: the same prompt again must not hit a prefix cache
    config = dict(
        max_model_len=4096, kv_cache_bytes=256 << 20, max_num_batched_tokens=4096, enable_prefix_caching=False
    )
    consumer = EngineActor.remote("bench-decode", "decode", **config)
    result: dict[str, float] = {}
    for name, pipelined in (("pipelined", True), ("not_pipelined", False)):
        producer = EngineActor.remote(f"bench-prefill-{name}", "prefill", push_pipelined=pipelined, **config)
        ray.get([consumer.start.remote(), producer.start.remote()] if name == "pipelined" else producer.start.remote())
        figures = []
        for rep in range(PIPELINE_REPEATS + 1):  # the first warms up
            request = GenerationRequest(f"{name}-{rep}", tuple(prompt), SamplingParams(max_tokens=2, temperature=0))
            dest = ray.get(consumer.reserve_push.remote(request))
            decoding = consumer.decode_push.remote(request, dest)
            _, stats = ray.get(producer.prefill_push.remote(request, dest))
            ray.get(decoding)
            figures.append(_push_figures(name, stats, pipelined))
        result.update(_median_figures(figures[1:]))
        if name == "not_pipelined":  # pull from a producer that never pushed (see TransferActor)
            ray.kill(producer)
            producer = EngineActor.remote("bench-prefill-pull", "prefill", **config)
            ray.get(producer.start.remote())
            pulls = []
            for rep in range(PIPELINE_REPEATS + 1):
                request = GenerationRequest(f"pull-{rep}", tuple(prompt), SamplingParams(max_tokens=2, temperature=0))
                _, handle = ray.get(producer.prefill_pull.remote(request))
                ray.get(consumer.decode_pull.remote(request, handle))
                pulls.append(ray.get(consumer.last_fetch_ms.remote()))
            result["pull_after_prefill_ms"] = statistics.median(pulls[1:])
        ray.kill(producer)
    ray.kill(consumer)
    result["pull_in_layers"] = result["pull_after_prefill_ms"] / result["pipelined_one_layer_ms"]
    return result


def _median_figures(figures: list[dict]) -> dict:
    """Median of each numeric figure over the repetitions; the last repetition's layer detail."""
    merged = {k: statistics.median(f[k] for f in figures) for k, v in figures[0].items() if isinstance(v, float)}
    return figures[-1] | merged


def _push_figures(name: str, stats, pipelined: bool) -> dict[str, float]:
    """From the layer timestamps (one clock: the producer's). Pipelined: the forward pass
    ends at the last layer's compute end; not pipelined: when the first write is posted."""
    layers = stats.layer_times
    compute_end = layers[-1].compute_end if pipelined else min(t.compute_end for t in layers)
    complete = max(t.done for t in layers)
    one_layer = statistics.median(t.done - t.posted for t in layers)
    last = {
        f"{name}_last_layers_ms": [
            {k: round((getattr(t, k) - compute_end) * 1e3, 3) for k in ("compute_end", "posted", "done")}
            for t in layers[-3:]
        ]
    }
    return last | {
        f"{name}_tail_ms": (complete - compute_end) * 1e3,
        f"{name}_one_layer_ms": one_layer * 1e3,
        f"{name}_tail_in_layers": (complete - compute_end) / one_layer,
        f"{name}_bytes": stats.num_bytes,
    }


BANDWIDTH = (
    "size (MB) | blocks | our NIXL pull | our NIXL push | object store | raw NIXL | raw NIXL, 60 descriptors"
    " | raw NIXL, 4 KB pages | torch copy (1 process) | pull / raw",
    "{size_mb:.1f} | {num_blocks} | {nixl_pull:.2f} | {nixl_push:.2f} | {object_store:.2f} | {raw_nixl:.2f}"
    " | {raw_nixl_60_descs:.2f} | {raw_nixl_4k_pages:.2f} | {torch_copy:.2f} | {pull_vs_raw:.2f}",
)


def render(summary: dict) -> list[str]:
    """The generated block of kv_transfer.md, from kv_transfer.json: the bandwidth table, the
    pull against its targets, the descriptors' own cost and the push pipelining table."""
    rows, pipe = summary["bandwidth_gb_per_s"], summary["push_pipelining"]
    one_layer = pipe["pipelined_one_layer_ms"]
    modes = [
        ["push, pipelined", f"{pipe['pipelined_tail_ms']:.1f}", pipe["pipelined_tail_in_layers"]],
        [
            "push, all layers after the forward",
            f"{pipe['not_pipelined_tail_ms']:.1f}",
            pipe["not_pipelined_tail_ms"] / one_layer,
        ],
        ["pull (fetch after prefill)", f"{pipe['pull_after_prefill_ms']:.1f}", pipe["pull_in_layers"]],
    ]
    return [
        f"Command: `{summary['command']}`. Two Ray actors (processes) on one 2-core CPU machine, NIXL over UCX",
        "on CPU memory; blocks of the default model's layout (30 layers x K/V x 16 tokens x 3 heads x 64,",
        f"float32, {BYTES_PER_BLOCK} bytes per block). GB/s = bytes / median time of {REPEATS} repetitions",
        f"after one warm-up; the {len(METHODS)} kinds take turns, each repetition starting with the next one.",
        "",
        *table(BANDWIDTH[0], [cells(BANDWIDTH[1], r) for r in rows]),
        "",
        "'raw NIXL' reads a buffer allocated as the engine's KV pool is (2 MB pages where the kernel",
        "allows, `engine/host_memory.py`), so 'pull / raw' compares the same memory; 'raw NIXL, 4 KB",
        "pages' is the same READ between two buffers madvised against huge pages, what the pool cost",
        "before it moved to huge pages. A request's KV in the pool layout `[layers, K/V, blocks, ...]`",
        "is at least 60 byte runs (30 layers x K/V), so our pull posts >= 60 descriptors where raw",
        "NIXL posts one; the column 'raw NIXL, 60 descriptors' is the same READ split like our layout,",
        "with none of our code around it. Pull and push run on two transports (each its own NIXL",
        "agents) in the same two processes, as a deployment runs one mode: a connection that carries",
        "pushes one way makes UCX finish each READ the other way only after a round trip with the peer.",
        "",
        *_target_lines(rows, summary["descriptor_cost"]),
        "## Layer-pipelined push, 2,048-token prompt (real prefill of the default model)",
        "",
        "Tail = (last layer's KV complete at decode) - (prefill compute end), from the per-layer",
        "timestamps; one layer = median (write done - write posted) of the pipelined run. Medians",
        f"of {PIPELINE_REPEATS} requests after one warm-up.",
        "",
        *table(
            "mode | tail (ms) | one layer (ms) | tail / one layer",
            [[m, tail, f"{one_layer:.2f}", f"{n:.2f}"] for m, tail, n in modes],
        ),
        "",
        "Target: pipelined tail <= 2x one layer's transfer time.",
        "",
        "![bandwidth](kv_transfer.png)",
    ]


def _target_lines(rows: list[dict], descs: dict) -> list[str]:
    """The pull against its targets (from 16 MB up), and the descriptors' own cost."""
    large, extra_us = [r for r in rows if r["size_mb"] >= 15], descs["per_extra_descriptor_us"]

    def ratios(numerator: str, denominator: str, suffix: str) -> str:
        return ", ".join(f"{r['size_mb']:.0f} MB {r[numerator] / r[denominator]:.2f}{suffix}" for r in large)

    return [
        "Target: our pull >= 0.9x raw NIXL from 16 MB up: "
        + ", ".join(f"{r['size_mb']:.0f} MB {r['pull_vs_raw']:.2f}" for r in large)
        + ". Against raw NIXL as 60 descriptors: "
        + ratios("nixl_pull", "raw_nixl_60_descs", "x")
        + ". The same READ as 60 descriptors, none of our code: "
        + ratios("raw_nixl_60_descs", "raw_nixl", "x raw")
        + ". Against raw NIXL on 4 KB pages our pull is "
        + ratios("nixl_pull", "raw_nixl_4k_pages", "x")
        + ".",
        "",
        f"The descriptors' own cost, same run: a raw READ of 60 x 64 B took {descs['sixty_descriptors_us']:.0f} us,",
        f"one of 64 B {descs['one_descriptor_us']:.0f} us: {extra_us:.1f} us per extra",
        "descriptor (NIXL prepares each, and UCX reads each between CPU memories with its own",
        f"`process_vm_readv` call), {59 * extra_us:.0f} us for a pull's 60 against",
        "one contiguous READ, before any of our code runs.",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.kv_transfer", description=first_paragraph(__doc__))
    parser.add_argument("--out", default="docs/benchmarks", help="folder for kv_transfer.json/.md/.png")
    parser.add_argument("--skip-pipelining", action="store_true")
    parser.add_argument("--only-pipelining", action="store_true", help="print the push pipelining figures only")
    args = parser.parse_args(argv)
    start_local_ray(object_store_memory=1 << 30)
    try:
        if args.only_pipelining:
            print(json.dumps(pipelining(), indent=2))
            return
        producer, consumer = TransferActor.remote("bench-producer"), TransferActor.remote("bench-consumer")
        rows, descs = bandwidth_table(producer, consumer), descriptor_cost_us(producer, consumer)
        ray.kill(producer)
        ray.kill(consumer)
        pipe = {} if args.skip_pipelining else pipelining()
    finally:
        ray.shutdown()
    out = Path(args.out)
    summary = {"command": command_line("bench.kv_transfer", argv), "bandwidth_gb_per_s": rows, "descriptor_cost": descs}
    write_json(out / "kv_transfer.json", summary | {"push_pipelining": pipe})
    with figure(out / "kv_transfer.png", 1, 1, (6, 4), dpi=100) as (ax, _):
        sizes = [r["size_mb"] for r in rows]
        for key, label in (("nixl_pull", "our NIXL pull"), ("nixl_push", "our NIXL push"), ("raw_nixl", "raw NIXL"),
                           ("object_store", "object store"), ("torch_copy", "torch copy, 1 process")):  # fmt: skip
            ax.plot(sizes, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="KV bytes per request (MB)", ylabel="GB/s")
        ax.set_title("KV transfer between two processes (CPU, UCX)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if pipe:
        new = template("bench.kv_transfer", "# KV transfer benchmark")
        write_page(out / "kv_transfer.md", "bench.kv_transfer", render(summary | {"push_pipelining": pipe}), new)
    else:
        print(json.dumps({"rows": rows, "descriptor_cost": descs}, indent=2))


if __name__ == "__main__":
    main()
