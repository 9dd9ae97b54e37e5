"""KV transfer between two processes: ``python -m bench.kv_transfer`` (docs/benchmarks/kv_transfer.md).

Bytes/s of our NIXL pull and push, the object store, raw NIXL reads and a torch copy over blocks of the default model's
KV layout; then the tail of a layer-pipelined push on a real prefill."""

from __future__ import annotations

import os
import statistics
import sys
import time

import ray
import torch

from app.local_cluster import start_local_ray, stop_local_ray
from bench.engine import corpus_ids, greedy_request
from bench.engine_actor import EngineActor
from bench.gpu_kv import KVSide, RawAgent
from bench.host import medians, seconds, tokenizer
from bench.report import arguments, cells, command_line, figure, publish, table
from engine.host_memory import host_tensor
from engine.kv_pool import KVLayout, KVPool
from kv_transport.nixl_transport import NixlTransport
from kv_transport.object_store import ObjectStoreTransport
from kv_transport.registry import RayPeerRegistry

SIZES_MB, REPEATS, PIPELINE_REPEATS = (1, 16, 64, 256), 21, 5
LAYOUT = KVLayout(dtype="float32", num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)  # the default model's
BYTES_PER_BLOCK, POOL_BLOCKS, RAW_BYTES = LAYOUT.bytes_per_block, 420, 256 << 20  # > 256 MB of blocks; a raw buffer
METHODS = ["nixl_pull", "nixl_push", "object_store", "raw_nixl", "raw_nixl_60_descs", "raw_nixl_4k_pages"]
BANDWIDTH = (
    "size (MB) | blocks | our NIXL pull | our NIXL push | object store | raw NIXL | raw NIXL, 60 descriptors"
    " | raw NIXL, 4 KB pages | torch copy (1 process) | pull / raw",
    "{size_mb:.1f} | {num_blocks} | {nixl_pull:.2f} | {nixl_push:.2f} | {object_store:.2f} | {raw_nixl:.2f}"
    " | {raw_nixl_60_descs:.2f} | {raw_nixl_4k_pages:.2f} | {torch_copy:.2f} | {pull_vs_raw:.2f}",
)
TARGETS = (  # the pull against its targets: text, numerator, denominator, suffix
    ("Target: our pull >= 0.9x raw NIXL from 16 MB up: ", "nixl_pull", "raw_nixl", ""),
    (". Against raw NIXL as 60 descriptors: ", "nixl_pull", "raw_nixl_60_descs", "x"),
    (". The same READ as 60 descriptors, none of our code: ", "raw_nixl_60_descs", "raw_nixl", "x raw"),
    (". Against raw NIXL on 4 KB pages our pull is ", "nixl_pull", "raw_nixl_4k_pages", "x"),
)
PLOTTED = {"nixl_pull": "our NIXL pull", "nixl_push": "our NIXL push", "raw_nixl": "raw NIXL",
           "object_store": "object store", "torch_copy": "torch copy, 1 process"}  # fmt: skip


@ray.remote(num_cpus=0.5)
class TransferActor(KVSide):
    """A KV pool of the default model's layout and its transports, no model; raw NIXL buffers on 2 MB, 4 KB pages."""

    def __init__(self, engine_id: str) -> None:
        torch.set_num_threads(1)
        # pull and push on their own NIXL agents, as a deployment runs one mode (kv_transfer.md)
        transports = {"nixl": NixlTransport(engine_id, LAYOUT, RayPeerRegistry()),
                      "push": NixlTransport(f"{engine_id}-push", LAYOUT, RayPeerRegistry()),
                      "store": ObjectStoreTransport(engine_id, LAYOUT)}  # fmt: skip
        raw = {"pool_pages": host_tensor((RAW_BYTES // 4,), torch.float32).uniform_(),
               "4k_pages": host_tensor((RAW_BYTES // 4,), torch.float32, huge_pages=False).uniform_()}  # fmt: skip
        pool = KVPool(LAYOUT, POOL_BLOCKS).tensor.uniform_()  # as the engine's pool
        super().__init__(pool, transports, RawAgent(f"raw-{engine_id}", raw))

    def raw_read_s(self, *read) -> float:
        return self.raw.read_s(*read)

    async def fetch_s(self, kind: str, handle) -> float:
        blocks = list(range(POOL_BLOCKS - sum(n for _, n in handle.block_ranges), POOL_BLOCKS))  # the caller's input
        start = time.perf_counter()
        await self.transports[kind].fetch(handle, blocks)
        return time.perf_counter() - start

    def destination(self, request_id: str, num_blocks: int):
        return self.transports["push"].destination(request_id, list(range(num_blocks)), num_blocks * LAYOUT.block_size)

    async def push_s(self, destination) -> float:
        push, blocks = self.transports["push"], list(range(POOL_BLOCKS - len(destination.block_ids), POOL_BLOCKS))
        push.begin_push(destination)
        start = time.perf_counter()
        for layer in range(LAYOUT.num_layers):
            push.push_layer(destination.request_id, layer, blocks, 0)
        await push.finish_push(destination.request_id, 1)
        return time.perf_counter() - start


def measure(method: str, producer, consumer, tag: str, num_blocks: int, raw: tuple | None = None) -> float:
    """Seconds of one transfer of ``num_blocks`` blocks by ``method`` (``raw``: the producer's ``raw_meta``)."""
    if method in ("nixl_pull", "object_store"):  # the object store's export copies out: it counts
        kind = "nixl" if method == "nixl_pull" else "store"
        (handle,), export_s = ray.get(producer.export.remote(kind, f"{kind}-{tag}", num_blocks))
        return (export_s if kind == "store" else 0.0) + ray.get(consumer.fetch_s.remote(kind, handle))
    if method == "nixl_push":
        dest = ray.get(consumer.destination.remote(f"push-{tag}", num_blocks))
        waiting = consumer.wait_push.remote(dest, "push")
        seconds = ray.get(producer.push_s.remote(dest))
        ray.get(waiting)
        return seconds
    num_descs, pages = 60 if method == "raw_nixl_60_descs" else 1, "4k_pages" if "4k" in method else "pool_pages"
    read = (raw, num_blocks * BYTES_PER_BLOCK, num_descs, pages, RAW_BYTES // num_descs)  # spread over the buffer
    return ray.get(consumer.raw_read_s.remote(*read))


def size_row(producer, consumer, raw: tuple, num_blocks: int) -> dict[str, float]:
    """GB/s of each method and of a torch copy in this process (all threads) over ``num_blocks`` blocks' bytes."""
    num_bytes = num_blocks * BYTES_PER_BLOCK
    once = lambda m, rep: measure(m, producer, consumer, f"{num_blocks}-{rep}", num_blocks, raw)  # noqa: E731
    gbps = {method: num_bytes / s / 1e9 for method, s in medians(METHODS, REPEATS, once).items()}
    src, dst = torch.rand(num_bytes // 4), torch.empty(num_bytes // 4)
    copy_s = medians(["copy"], REPEATS, lambda *_: seconds(lambda: dst.copy_(src)))["copy"]
    print(f"  {num_bytes / 2**20:.0f} MB done", file=sys.stderr, flush=True)
    return {"size_mb": num_bytes / 2**20, "num_blocks": num_blocks, **gbps, "torch_copy": num_bytes / copy_s / 1e9,
            "pull_vs_raw": gbps["nixl_pull"] / gbps["raw_nixl"]}  # fmt: skip


def pipelining(prompt_len: int = 2048) -> dict[str, float]:
    """Medians of the push tails (pipelined or not) and of the pull after prefill, one decode engine."""
    prompt = corpus_ids(tokenizer(), prompt_len)
    # every repetition prefills (and moves) the whole prompt: the same prompt again must not hit a prefix cache
    config = {"max_model_len": 4096, "kv_cache_bytes": 256 << 20, "max_num_batched_tokens": 4096,
              "enable_prefix_caching": False}  # fmt: skip
    consumer, result = EngineActor.remote("bench-decode", "decode", **config), {}
    ray.get(consumer.start.remote())
    for mode in ("pipelined", "not_pipelined", "pull"):  # the pull from a producer that never pushed
        producer = EngineActor.remote(f"bench-prefill-{mode}", "prefill", push_pipelined=mode == "pipelined", **config)
        ray.get(producer.start.remote())
        figures = []
        for rep in range(PIPELINE_REPEATS + 1):  # the first warms up
            request = greedy_request(f"{mode}-{rep}", prompt, 2, ignore_eos=False)
            if mode == "pull":
                ray.get(consumer.decode_pull.remote(request, ray.get(producer.prefill_pull.remote(request))[1]))
                figures.append({"pull_after_prefill_ms": ray.get(consumer.last_fetch_ms.remote())})
                continue
            decoding = consumer.decode_push.remote(request, dest := ray.get(consumer.reserve_push.remote(request)))
            _, stats = ray.get(producer.prefill_push.remote(request, dest))
            ray.get(decoding)
            figures.append(push_figures(mode, stats.layer_times, mode == "pipelined"))
        result |= {key: statistics.median(f[key] for f in figures[1:]) for key in figures[0]}
        ray.kill(producer)
    ray.kill(consumer)
    result["pull_in_layers"] = result["pull_after_prefill_ms"] / result["pipelined_one_layer_ms"]
    return result


def push_figures(mode: str, layers: list, pipelined: bool) -> dict[str, float]:
    """Tail and one layer's write from the layer timestamps (one clock: the producer's). The
    forward pass ends at the last layer's compute end (pipelined) or the first's (not)."""
    compute_end = layers[-1].compute_end if pipelined else min(t.compute_end for t in layers)
    tail, one_layer = max(t.done for t in layers) - compute_end, statistics.median(t.done - t.posted for t in layers)
    return {f"{mode}_tail_ms": tail * 1e3, f"{mode}_one_layer_ms": one_layer * 1e3,
            f"{mode}_tail_in_layers": tail / one_layer}  # fmt: skip


def render(summary: dict) -> list[str]:
    rows, pipe = summary["bandwidth_gb_per_s"], summary["push_pipelining"]
    large, one = [r for r in rows if r["size_mb"] >= 15], pipe["pipelined_one_layer_ms"]
    targets = "".join(text + ", ".join(f"{r['size_mb']:.0f} MB {r[num] / r[den]:.2f}{suffix}" for r in large)
                      for text, num, den, suffix in TARGETS)  # fmt: skip
    modes = (
        ("push, pipelined", pipe["pipelined_tail_ms"], pipe["pipelined_tail_in_layers"]),
        ("push, all layers after the forward", pipe["not_pipelined_tail_ms"], pipe["not_pipelined_tail_ms"] / one),
        ("pull (fetch after prefill)", pipe["pull_after_prefill_ms"], pipe["pull_in_layers"]),
    )
    return [
        f"Command: `{summary['command']}` (setup below). GB/s = bytes / median time of {REPEATS} repetitions after",
        f"one warm-up; the {len(METHODS)} kinds take turns, each repetition starting with the next one.", "",
        *table(BANDWIDTH[0], [cells(BANDWIDTH[1], r) for r in rows]), "", targets + ".", "",
        "## Layer-pipelined push, 2,048-token prompt (real prefill of the default model)", "",
        "Tail = (last layer's KV complete at decode) - (prefill compute end), from the per-layer",
        "timestamps; one layer = median (write done - write posted) of the pipelined run. Medians",
        f"of {PIPELINE_REPEATS} requests after one warm-up.", "",
        *table("mode | tail (ms) | one layer (ms) | tail / one layer",
               [[mode, f"{tail:.1f}", f"{one:.2f}", f"{n:.2f}"] for mode, tail, n in modes]),
        "", "Target: pipelined tail <= 2x one layer's transfer time.", "", "![bandwidth](kv_transfer.png)",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = arguments("bench.kv_transfer", __doc__, "docs/benchmarks", "folder for kv_transfer.json/.md/.png")
    args = parser.parse_args(argv)
    start_local_ray(object_store_memory=1 << 30)
    try:
        producer, consumer = TransferActor.remote("bench-producer"), TransferActor.remote("bench-consumer")
        raw = ray.get(producer.raw_meta.remote())
        torch.set_num_threads(os.cpu_count() or 1)
        rows = [size_row(producer, consumer, raw, max(1, round(mb * 2**20 / BYTES_PER_BLOCK))) for mb in SIZES_MB]
        ray.kill(producer)
        ray.kill(consumer)
        pipe = pipelining()
    finally:
        stop_local_ray()
    summary = {"command": command_line("bench.kv_transfer", argv), "bandwidth_gb_per_s": rows, "push_pipelining": pipe}
    publish(args.out, "kv_transfer", "bench.kv_transfer", summary, render(summary), "# KV transfer benchmark")
    with figure(args.out / "kv_transfer.png", 1, 1, (6, 4), dpi=100, legend={}) as (ax, _):  # the JSON's folder
        for key, label in PLOTTED.items():
            ax.plot([r["size_mb"] for r in rows], [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="KV bytes per request (MB)", ylabel="GB/s",
               title="KV transfer between two processes (CPU, UCX)")  # fmt: skip


if __name__ == "__main__":
    main()
