"""KV over NIXL between two processes on one GPU, no Ray: ``python3 -m bench.gpu_kv [--out PATH] [--cpu]``.

Our pull against a raw NIXL READ of the same bytes (as one descriptor and as many as ours), the push's tail
behind the last layer's simulated forward, both also through pinned host staging, and the UCX transports used.
Each side is a one-worker process pool holding a ``KVSide``; a failed or hung row kills both for a fresh pair."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch

from bench.host import synchronize, timed
from bench.report import arguments, cells, table, write_json
from engine.host_memory import host_tensor
from engine.kv_pool import KVLayout, KVPool
from kv_transport.base import BaseKVTransport, LayerTiming
from kv_transport.handle import KVDestination, KVHandle
from kv_transport.nixl_transport import NixlTransport
from kv_transport.registry import LocalPeerRegistry, PeerInfo

PRODUCER, CONSUMER = "producer", "consumer"  # the engine ids of the two processes' unstaged transports
RAW_PROGRESS_S = 0.001  # the raw agents' progress on the side being read
_WORKER: dict = {}  # this worker process's side and event loop (``side_call``'s state)
_UCX_TABLE = re.compile(r"^\[[\d.]+\] \[[^]]*\]\s+[|+]")  # a line of a UCX_PROTO_INFO table
_RANGE = re.compile(r"^\d[\dKMGT]*(\.\.(\d[\dKMGT]*|inf))?$")  # "0", "1..16515", "8K..inf"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures, the same in all three processes."""

    device: str  # "cuda" or "cpu"
    layout: KVLayout
    sizes_mb: tuple[int, ...]
    num_repeats: int  # timed repetitions per size, after one warm-up
    push_blocks: int  # the prompt's blocks, pushed layer by layer
    num_push_repeats: int  # timed pushes, after one warm-up
    compute_ms: float  # the simulated forward of one layer
    start_timeout_s: float  # spawn, imports, CUDA and NIXL set-up of the two processes
    row_timeout_s: float
    budget_s: float  # the whole run
    kv_transfer_timeout_s: float = 20.0  # the transports' (handles expire after it)
    staging_sizes_mb: tuple[int, ...] = ()  # pulls through the staging transports
    num_staged_repeats: int = 5  # each export holds its staging slots until fetched
    staging_bytes: int = 1 << 30  # each staging transport's pinned buffer
    stagings: tuple[str, ...] = ("none", "host")  # the sections run (``SECTIONS``)
    push: bool = True  # each section's push row
    notice_poll_s: float | None = None  # the transports' (None: NixlTransport's default)

    def blocks_for(self, size_mb: float) -> int:
        return max(1, round(size_mb * 2**20 / self.layout.bytes_per_block))

    @property
    def pool_blocks(self) -> int:
        return max([self.push_blocks, *(self.blocks_for(size) for size in self.sizes_mb)]) + 8

    @property
    def raw_bytes(self) -> int:
        """Twice the largest size: a READ split into pieces leaves a gap after each (or they might merge)."""
        return 2 * max([1, *(self.blocks_for(size) for size in self.sizes_mb)]) * self.layout.bytes_per_block


# An 8B-class model's KV (32 layers x 8 KV heads of 128, bfloat16: 2 MB per 16-token block). Pulls of 16, 64
# and 256 MB, 12 each; a 2,048-token prompt (128 blocks) pushed 5 times behind a 1 ms forward per layer (about
# one layer of its prefill); 45 s to start, 20 s a row, 70 s in all (the GPU check's section has 75); staged
# pulls of 16 and 64 MB, 5 each, through 768 MB of pinned memory per side (6 exports of 64 MB, or a push's 256 MB).
GPU_PLAN = Plan("cuda", KVLayout(32, 8, 128, 16, "bfloat16"), (16, 64, 256), 12, 128, 5, 1.0, 45.0, 20.0, 70.0,
                staging_sizes_mb=(16, 64), num_staged_repeats=5, staging_bytes=768 << 20)  # fmt: skip
CPU_PLAN = Plan("cpu", KVLayout(8, 2, 64, 16, "bfloat16"), (1, 4), 8, 16, 3, 2.0, 30.0, 10.0, 50.0, 20.0, (1, 4), 3,
                64 << 20)  # fmt: skip
SECTIONS = (("none", "pull_vs_raw", "push"), ("host", "staged_pull", "staged_push"))  # staging, its JSON keys
PULL = (
    "staging | size (MB) | blocks | our descriptors | raw READ (GB/s) | raw READ, as many descriptors (GB/s)"
    " | our pull (GB/s) | pull / raw (>= 0.9) | pull / raw as many | bytes ok",
    "{staging} | {size_mb:.1f} | {num_blocks} | {num_descriptors} | {raw_gb_per_s:.1f} | {raw_split_gb_per_s:.1f}"
    " | {pull_gb_per_s:.2f} | {pull_vs_raw:.2f} | {pull_vs_raw_split:.2f} | {ok}",
)
PUSH = (
    "staging | forward per layer, measured (ms) | one layer's write (ms) | tail to notice (ms)"
    " | tail / one layer (<= 2) | tail to last write (ms) | last write / one layer | tail to notice sent (ms)"
    " | bytes ok",
    "{staging} | {compute_per_layer_ms:.3f} | {one_layer_ms:.3f} | {tail_to_notice_ms:.3f} | {tail_in_layers:.2f}"
    " | {tail_to_last_write_ms:.3f} | {last_write_in_layers:.2f} | {tail_to_notice_sent_ms:.3f} | {ok}",
)
LAYER = "{layer} | {compute_end_ms:.3f} | {push_layer_called_ms:.3f} | {posted_ms:.3f} | {done_ms:.3f}"


@dataclasses.dataclass(frozen=True)
class BandwidthResult:
    """Seconds per transfer of one size by kind ("raw", "raw_split", "pull"), the first a warm-up."""

    times: dict[str, tuple[float, ...]]
    num_descriptors: int  # of our pull
    bytes_ok: bool  # the first pull's blocks equal the producer's


@dataclasses.dataclass(frozen=True)
class PushRun:
    """The transport's layer timings (``compute_end``: ``push_layer``'s call), each forward's end, the notice's."""

    layer_times: tuple[LayerTiming, ...]
    compute_end: tuple[float, ...]
    num_bytes: int
    notice_sent: float | None = None


class SharedDictRegistry(LocalPeerRegistry):
    """``LocalPeerRegistry``'s rules over a ``multiprocessing.Manager`` dict, which every process shares."""

    def __init__(self, entries: MutableMapping[str, PeerInfo]) -> None:
        self._entries = entries


def side_call(command: str, *args: object) -> object:
    """Run a parent's command on this worker's ``_Side``; ``start`` makes it, output to the log named last."""
    if command == "start":
        *args, log_path = args
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (1, 2):
            os.dup2(fd, stream)
        os.close(fd)
        return _WORKER.update(side=_Side(*args), loop=asyncio.new_event_loop())
    result = getattr(_WORKER["side"], command)(*args)
    return _WORKER["loop"].run_until_complete(result) if asyncio.iscoroutine(result) else result


def _pattern(pool: torch.Tensor) -> torch.Tensor:
    """The producer's pool contents, reproducible in the consumer to check what arrived."""
    generator = torch.Generator(device=pool.device).manual_seed(1234)
    return torch.randn(pool.shape, generator=generator, device=pool.device).to(pool.dtype)


class KVSide:
    """One engine's KV pool, its transports by kind (each registers the pool) and a bare NIXL agent."""

    def __init__(self, pool: torch.Tensor, transports: dict[str, BaseKVTransport], raw: RawAgent) -> None:
        self.pool, self.transports, self.raw, self.released = pool, transports, raw, []
        for transport in transports.values():  # the same pool under all
            transport.register_pool(pool, self.released.append)

    def raw_meta(self) -> tuple[bytes, dict[str, int], int]:
        return self.raw.meta()

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()

    def export(self, kind: str, tag: str, num_blocks: int, count: int = 1) -> tuple[list[KVHandle], float]:
        """``count`` exports of the first ``num_blocks`` blocks, and the seconds they took."""
        transport = self.transports[kind]
        tokens = num_blocks * transport.layout.block_size
        return timed(lambda: [transport.export(f"{tag}-{i}", list(range(num_blocks)), tokens, 1) for i in range(count)])

    async def wait_push(self, destination: KVDestination, kind: str) -> tuple[float, float | None]:
        """When the push's completion was seen here (staged: once in the pool) and its notice read (unix s)."""
        completion = await self.transports[kind].wait_push(destination)
        return time.time(), completion.received_at


class _Side(KVSide):
    """``bench.gpu_kv``'s side: transports "none" and "host" (staged), the producer's pool a known pattern."""

    def __init__(self, role: str, plan: Plan, entries: MutableMapping[str, PeerInfo]) -> None:
        self.plan = plan
        if plan.device == "cuda":
            torch.cuda.set_device(0)
        pool = KVPool(plan.layout, plan.pool_blocks, plan.device).tensor
        if role == PRODUCER:
            pool.copy_(_pattern(pool))
        synchronize(plan.device)  # written before anyone reads it
        registry, staged = SharedDictRegistry(entries), {"staging": "host", "staging_bytes": plan.staging_bytes}
        poll = {} if plan.notice_poll_s is None else {"notice_poll_s": plan.notice_poll_s}
        kinds = (("none", role, poll), ("host", f"{role}-staged", staged | poll))
        transports = {
            kind: NixlTransport(name, plan.layout, registry, kv_transfer_timeout_s=plan.kv_transfer_timeout_s, **extra)
            for kind, name, extra in kinds
            if kind in plan.stagings
        }
        if plan.device == "cuda":
            raw = torch.ones(plan.raw_bytes, dtype=torch.uint8, device="cuda")
        else:  # memory as the CPU pool's (2 MB pages), so the two compare on the same pages
            raw = host_tensor((plan.raw_bytes,), torch.uint8).fill_(1)
        super().__init__(pool, transports, RawAgent(f"raw-{role}", {"pool_pages": raw}))
        self.compute = _LayerCompute(plan) if role == PRODUCER else None

    def _tail_blocks(self, count: int) -> list[int]:
        """The consumer's blocks, zeroed: a check after a transfer sees its bytes, not an earlier one's."""
        blocks = list(range(self.plan.pool_blocks - count, self.plan.pool_blocks))
        self.pool[:, :, blocks] = 0
        synchronize(self.plan.device)
        return blocks

    def _matches(self, local: list[int], remote: list[int]) -> bool:
        return torch.equal(self.pool[:, :, local], _pattern(self.pool)[:, :, remote])

    async def push(self, destination: KVDestination, staging: str) -> PushRun:
        """Push every layer right after its simulated forward, as the engine's layer hook does."""
        request_id, transport = destination.request_id, self.transports[staging]
        blocks = list(range(len(destination.block_ids)))
        transport.begin_push(destination)
        self.compute.start()
        for layer in range(self.plan.layout.num_layers):
            with self.compute.layer():  # on CUDA push_layer records its event on the compute stream
                transport.push_layer(request_id, layer, blocks, 0)
        stats = await transport.finish_push(request_id, first_token=1)
        return PushRun(stats.layer_times, self.compute.ends(), stats.num_bytes, stats.notice_sent)

    async def bandwidth(self, handles: list, raw_peer: tuple, num_bytes: int, num_pieces: int, staging: str):
        """Per handle our pull, a raw READ of the bytes and one in ``num_pieces`` (staged: pulls alone)."""
        local = self._tail_blocks(len(handles[0].block_ids))
        kinds = ["raw", "raw_split", "pull"] if staging == "none" else ["pull"]
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        num_descriptors, bytes_ok = 0, False
        for i, handle in enumerate(handles):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                if kind != "pull":
                    times[kind].append(self.raw.read_s(raw_peer, num_bytes, num_pieces if kind == "raw_split" else 1))
                    continue
                start = time.perf_counter()
                stats = await self.transports[staging].fetch(handle, local)
                times["pull"].append(time.perf_counter() - start)
                if i == 0:
                    num_descriptors, bytes_ok = stats.num_descriptors, self._matches(local, handle.block_ids)
        return BandwidthResult({kind: tuple(t) for kind, t in times.items()}, num_descriptors, bytes_ok)

    def destination(self, request_id: str, num_blocks: int, staging: str) -> KVDestination:
        tokens = num_blocks * self.plan.layout.block_size
        return self.transports[staging].destination(request_id, self._tail_blocks(num_blocks), tokens)

    async def wait_push(self, destination: KVDestination, staging: str, verify: bool = False) -> tuple:
        """The notice's arrival, if asked whether the bytes arrived, and when it was read."""
        (seen, received), blocks = await super().wait_push(destination, staging), destination.block_ids
        return seen, self._matches(blocks, list(range(len(blocks)))) if verify else None, received


class _LayerCompute:
    """Forwards of known duration and their ends: on CUDA a GPU sleep and an event after it, else a sleep."""

    def __init__(self, plan: Plan) -> None:
        self.seconds, self.cuda, self._ends = plan.compute_ms / 1e3, plan.device == "cuda", []
        if self.cuda:  # ``torch.cuda._sleep`` spins for a number of GPU cycles: how many make a second
            self.stream, cycles = torch.cuda.Stream(), 20_000_000
            torch.cuda._sleep(100_000)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self.cycles = int(self.seconds * (cycles / (start.elapsed_time(end) / 1e3)))

    def start(self) -> None:
        self._ends = []
        if self.cuda:
            torch.cuda.synchronize()
            # read before the reference event runs: the ends come out late by the launch latency, never early
            self._origin_unix = time.time()
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record(self.stream)

    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        """One forward, then the body (on CUDA on the compute stream: ``push_layer`` records its event there)."""
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if self.cuda:
                torch.cuda._sleep(self.cycles)
                self._ends.append(torch.cuda.Event(enable_timing=True))
                self._ends[-1].record()
            else:
                time.sleep(self.seconds)
                self._ends.append(time.time())
            yield

    def ends(self) -> tuple[float, ...]:
        if not self.cuda:
            return tuple(self._ends)
        torch.cuda.synchronize()
        return tuple(self._origin_unix + self._origin.elapsed_time(e) / 1e3 for e in self._ends)


class RawAgent:
    """A bare NIXL agent as ``NixlWorker``'s data agent (UCX, our own progress thread) for the raw READ."""

    def __init__(self, name: str, buffers: dict[str, torch.Tensor]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.buffers, first = buffers, next(iter(buffers.values()))
        self.mem_type, self.device_id = "VRAM" if first.is_cuda else "DRAM", max(first.get_device(), 0)
        for buffer in buffers.values():
            self.agent.register_memory(buffer)
        self.lock, self._peers = threading.Lock(), {}  # peer agents' names by their metadata
        threading.Thread(target=self._progress, args=(first.is_cuda,), daemon=True).start()

    def _progress(self, cuda: bool) -> None:
        """Progress UCX on the side being read (connection set-up needs its answers)."""
        if cuda:  # the GPU's primary context current here (as ``NixlWorker.bind_cuda``)
            torch.cuda.set_device(0)
            torch.cuda.current_stream().query()
        while True:
            with self.lock:
                self.agent.get_new_notifs()
            time.sleep(RAW_PROGRESS_S)

    def meta(self) -> tuple[bytes, dict[str, int], int]:
        return self.agent.get_agent_metadata(), {k: b.data_ptr() for k, b in self.buffers.items()}, self.device_id

    def read_s(self, peer: tuple, num_bytes: int, num_pieces: int = 1, buffer: str = "pool_pages", stride: int = 0):
        """Seconds of one READ of ``num_bytes`` from the peer's ``buffer`` as ``num_pieces`` descriptors
        ``stride`` apart (0: a gap after each), polled in a tight loop."""
        metadata, addresses, device = peer
        piece = num_bytes // num_pieces
        offsets = [k * (stride or 2 * piece) for k in range(num_pieces)]
        local = [(self.buffers[buffer].data_ptr() + o, piece, self.device_id) for o in offsets]
        remote = [(addresses[buffer] + o, piece, device) for o in offsets]
        local, remote = (self.agent.get_xfer_descs(descs, self.mem_type) for descs in (local, remote))
        with self.lock:
            if metadata not in self._peers:
                self._peers[metadata] = self.agent.add_remote_agent(metadata)
            start = time.perf_counter()
            handle = self.agent.initialize_xfer("READ", local, remote, self._peers[metadata])
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - start
            self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return elapsed


class _Pair:
    """The two sides' one-worker process pools (spawned): started on first use, killed after a failure."""

    def __init__(self, plan: Plan, entries, log_dir: Path) -> None:
        self.plan, self.entries, self.log_dir, self.num_starts = plan, entries, log_dir, 0
        self._pools: dict[str, ProcessPoolExecutor] = {}

    @property
    def started(self) -> bool:
        return bool(self._pools)

    def ensure_started(self, deadline: float) -> None:
        if self._pools:
            return
        self.num_starts += 1
        spawn = multiprocessing.get_context("spawn")
        self._pools = {role: ProcessPoolExecutor(1, spawn) for role in (PRODUCER, CONSUMER)}
        logs = {role: str(self.log_dir / f"{role}-{self.num_starts}.log") for role in self._pools}
        for future in [self.submit(role, "start", role, self.plan, self.entries, logs[role]) for role in self._pools]:
            self.wait(future, deadline)  # each answers once its pool and transports are up

    def submit(self, role: str, command: str, *args: object) -> Future:
        return self._pools[role].submit(side_call, command, *args)

    def wait(self, future: Future, deadline: float) -> object:
        try:
            return future.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError("no answer within the row's time") from None

    def call(self, role: str, command: str, *args: object, deadline: float) -> object:
        return self.wait(self.submit(role, command, *args), deadline)

    def kill(self) -> None:
        for pool in self._pools.values():
            for process in list((pool._processes or {}).values()):  # no public way to end a worker that hangs
                process.kill()
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools = {}

    def close(self) -> None:
        """Close both sides' transports (memory deregistered, registry left), then end the processes."""
        with contextlib.suppress(Exception):
            for future in [self.submit(role, "close") for role in self._pools]:
                self.wait(future, time.monotonic() + 5)
        self.kill()

    def log_tails(self, num_lines: int = 8) -> str:
        """The last lines each process logged, without UCX's protocol tables."""
        lines = []
        for path in sorted(self.log_dir.glob(f"*-{self.num_starts}.log")):
            logged = [line for line in path.read_text(errors="replace").splitlines() if not _UCX_TABLE.match(line)]
            lines += [f"  [{path.stem}] {line}" for line in logged[-num_lines:]]
        return "\n".join(lines)


def pull_row(pair: _Pair, size_mb: int, staging: str, deadline: float) -> dict:
    """Our pulls of ``size_mb`` MB and (unstaged) the raw READs of the same bytes, taking turns."""
    plan, tag = pair.plan, f"pull{size_mb}-{staging}"
    num_blocks = plan.blocks_for(size_mb)
    num_bytes = num_blocks * plan.layout.bytes_per_block
    count = (plan.num_repeats if staging == "none" else plan.num_staged_repeats) + 1
    handles, _ = pair.call(PRODUCER, "export", staging, tag, num_blocks, count, deadline=deadline)
    raw_peer = pair.call(PRODUCER, "raw_meta", deadline=deadline)
    num_pieces = 2 * plan.layout.num_layers  # our pull's descriptors: one run per layer and K/V
    result = pair.call(CONSUMER, "bandwidth", handles, raw_peer, num_bytes, num_pieces, staging, deadline=deadline)
    return pull_figures(result, num_blocks, num_bytes)


def pull_figures(result: BandwidthResult, num_blocks: int, num_bytes: int) -> dict:
    """Each kind's median after the warm-up (us, GB/s) and the pull against each raw READ."""
    row = {"size_mb": num_bytes / 2**20, "num_blocks": num_blocks, "num_descriptors": result.num_descriptors}
    medians = {kind: statistics.median(times[1:]) for kind, times in result.times.items()}
    for kind, seconds in medians.items():
        row |= {f"{kind}_us": seconds * 1e6, f"{kind}_gb_per_s": num_bytes / seconds / 1e9}
    for kind in ("raw", "raw_split") if "raw" in medians else ():
        row[f"pull_vs_{kind}"] = medians[kind] / medians["pull"]
    return row | {"bytes_ok": result.bytes_ok}


def push_row(pair: _Pair, staging: str, deadline: float) -> dict:
    """Pushes of ``plan.push_blocks`` blocks: medians after a warm-up, which checks the bytes."""
    plan, figures = pair.plan, []
    for rep in range(plan.num_push_repeats + 1):
        dest = pair.call(CONSUMER, "destination", f"push-{staging}-{rep}", plan.push_blocks, staging, deadline=deadline)
        waiting = pair.submit(CONSUMER, "wait_push", dest, staging, rep == 0)  # while the producer pushes
        run = pair.call(PRODUCER, "push", dest, staging, deadline=deadline)
        notice_at, bytes_ok, *received = pair.wait(waiting, deadline)
        figures.append(push_figures(run, notice_at, *received) | {"bytes_ok": bytes_ok})
    medians = {k: statistics.median(f[k] for f in figures[1:]) for k, v in figures[1].items() if isinstance(v, float)}
    return figures[-1] | medians | {"bytes_ok": figures[0]["bytes_ok"], "num_layers": plan.layout.num_layers}


def push_figures(run: PushRun, notice_at: float, received_at: float | None = None) -> dict:
    """One push's figures in ms by both processes' unix time; ``received_at``: when the notice was read."""
    times, ends, last_end = run.layer_times, run.compute_end, run.compute_end[-1]
    one_layer = max(statistics.median(t.done - t.posted for t in times), 1e-9)
    to_notice, to_last_write = notice_at - last_end, max(t.done for t in times) - last_end

    def ms(seconds: float) -> float:
        return round(seconds * 1e3, 3)

    last_layers = [
        {"layer": t.layer, "compute_end_ms": ms(e - last_end), "push_layer_called_ms": ms(t.compute_end - last_end),
         "posted_ms": ms(t.posted - last_end), "done_ms": ms(t.done - last_end)}
        for t, e in zip(times[-3:], ends[-3:])
    ]  # fmt: skip
    return {"layer_bytes": run.num_bytes // len(times), "one_layer_ms": one_layer * 1e3,
            "tail_to_notice_ms": to_notice * 1e3, "tail_to_last_write_ms": to_last_write * 1e3,
            "tail_to_notice_sent_ms": None if run.notice_sent is None else (run.notice_sent - last_end) * 1e3,
            "tail_to_notice_read_ms": None if received_at is None else (received_at - last_end) * 1e3,
            "tail_in_layers": to_notice / one_layer, "last_write_in_layers": to_last_write / one_layer,
            "compute_per_layer_ms": statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e3,
            "posted_after_compute_ms": statistics.median(t.posted - e for t, e in zip(times, ends)) * 1e3,
            "call_before_compute_end_ms": statistics.median(e - t.compute_end for t, e in zip(times, ends)) * 1e3,
            "last_layers": last_layers}  # fmt: skip


def ucx_transports(log_dir: Path) -> list[str]:
    """``<operation>: <protocol> via <transport/device>``, GPU memory first, from the logs' ``UCX_PROTO_INFO`` tables
    of remote memory access: a ``| remote memory ... |`` title, then ``| range | protocol | via |`` rows."""
    found: dict[str, None] = {}  # in order, once each
    for path in sorted(log_dir.glob("*.log")):
        operation = None
        for line in path.read_text(errors="replace").splitlines():
            parts = [c.strip() for c in line.partition("|")[2].split("|") if c.strip()]
            titles = [c for c in parts if c.startswith("remote memory")]
            if titles:
                operation = titles[0]
            elif 0 < len(parts) <= 2:  # the title of another table (or the context's line)
                operation = None
            elif operation and len(parts) == 3 and _RANGE.match(parts[0]):
                found[f"{operation}: {parts[1]} via {parts[2]}"] = None
    return sorted(found, key=lambda entry: "cuda" not in entry)


def guarded(pair: _Pair, budget_deadline: float, measure: Callable[..., dict], *args: object) -> dict:
    """``measure(*args, deadline)`` in the row's time; a failure (a hang too) is the row and kills the pair."""
    remaining = budget_deadline - time.monotonic()
    if remaining < 1:
        return {"error": "skipped: out of time"}
    limit = pair.plan.row_timeout_s + (0 if pair.started else pair.plan.start_timeout_s)
    try:
        deadline = time.monotonic() + min(limit, remaining)
        pair.ensure_started(deadline)
        return measure(*args, deadline)
    except Exception as exc:
        remote = f"{exc.__cause__}\n" if exc.__cause__ else ""  # a worker's traceback
        print(f"row failed: {type(exc).__name__}: {exc}\n{remote}{pair.log_tails()}", file=sys.stderr, flush=True)
        pair.kill()
        return {"error": f"failed: {type(exc).__name__}: {exc}".replace("|", "/")}


def _cells(template: str, row: dict) -> str:
    if "error" in row:
        return " | ".join(str(row[k]) for k in ("staging", "requested_mb", "error") if k in row)
    return cells(template, collections.defaultdict(lambda: None, row, ok="yes" if row["bytes_ok"] else "NO"), "")


def render(result: dict) -> list[str]:
    plan, layers = result["plan"], result["plan"]["layout"]["num_layers"]
    pulls = [{"staging": staging} | row for staging, key, _ in SECTIONS for row in result.get(key, [])]
    pushes = [{"staging": staging} | result[key] for staging, _, key in SECTIONS if key in result]
    mem = "VRAM" if plan["device"] == "cuda" else "DRAM"
    lines = [f"## KV over NIXL, {mem} -> {mem}, two processes, {layers} layers x K/V; medians after one warm-up",
             "", *table(PULL[0], [_cells(PULL[1], row) for row in pulls]), "",
             f"## push of {plan['push_blocks']} blocks, a simulated forward of {plan['compute_ms']:.2f} ms per layer:",
             "", *table(PUSH[0], [_cells(PUSH[1], row) for row in pushes])]  # fmt: skip
    for push in (push for push in pushes if "error" not in push):
        posted, called = push["posted_after_compute_ms"], -push["call_before_compute_end_ms"]
        median = f"median of all layers | 0 | {called:.3f} | {posted:.3f} | {posted + push['one_layer_ms']:.3f}"
        rows = [*(cells(LAYER, t) for t in push["last_layers"]), median]
        lines += ["", f"## last layers of the last push (staging={push['staging']}), ms from the last one's compute end"
                  " (compute end: its event on the GPU; push_layer called: the host call, LayerTiming.compute_end):",
                  "", *table("layer | compute end | push_layer called | posted | done", rows)]  # fmt: skip
    found = [entry.replace("|", "/") for entry in result.get("ucx_transports", [])[:8]]
    return [*lines, "", *table(["UCX protocol (UCX_PROTO_INFO)"], found or ["not reported: no tables in the logs"])]


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split(",") if size.strip())


def _stagings(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    if not kinds or set(kinds) - {"none", "host"}:
        raise argparse.ArgumentTypeError(f"expected 'none', 'host' or both, got {text!r}")
    return kinds


def main(argv: list[str] | None = None) -> None:
    parser = arguments("bench.gpu_kv", __doc__.splitlines()[0], help="write the figures as JSON here")
    parser.add_argument("--cpu", action="store_true", help="CPU pools (DRAM) and small sizes: a dry run")
    parser.add_argument("--sizes", type=_sizes, help="unstaged pull sizes in MB, comma-separated ('' for none)")
    parser.add_argument("--staged-sizes", type=_sizes, help="staged pull sizes in MB, likewise")
    parser.add_argument("--staging", type=_stagings, help="'none', 'host' or 'none,host' (the default)")
    parser.add_argument("--no-push", action="store_true", help="pulls only")
    parser.add_argument("--notice-poll-ms", type=float, help="the transports' notice poll (default NixlTransport's)")
    args = parser.parse_args(argv)
    poll_s = None if args.notice_poll_ms is None else args.notice_poll_ms / 1e3
    changes = dict(stagings=args.staging, push=False if args.no_push else None, notice_poll_s=poll_s)
    changes |= {"sizes_mb": args.sizes, "staging_sizes_mb": args.staged_sizes}
    plan = CPU_PLAN if args.cpu else GPU_PLAN
    plan = dataclasses.replace(plan, **{k: v for k, v in changes.items() if v is not None})
    result: dict = {"plan": dataclasses.asdict(plan)}
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("| gpu_kv | skipped: no CUDA (use --cpu for the dry run) |")
        result["skipped"] = "no CUDA"
    else:
        os.environ.setdefault("UCX_PROTO_INFO", "y")  # read by UCX in the two processes
        with multiprocessing.get_context("spawn").Manager() as manager, tempfile.TemporaryDirectory() as log_dir:
            pair, deadline = _Pair(plan, manager.dict(), Path(log_dir)), time.monotonic() + plan.budget_s
            try:  # the pulls against the raw READ per size and the push, then the same through host staging
                for (staging, pulls, push), sizes in zip(SECTIONS, (plan.sizes_mb, plan.staging_sizes_mb)):
                    if staging not in plan.stagings:
                        continue
                    rows = [guarded(pair, deadline, pull_row, pair, size, staging) for size in sizes]
                    result[pulls] = [{"requested_mb": size} | row for size, row in zip(sizes, rows)]
                    if plan.push:
                        result[push] = guarded(pair, deadline, push_row, pair, staging)
            finally:
                pair.close()
            result["ucx_transports"] = ucx_transports(Path(log_dir))
        print(*render(result), sep="\n")
    if args.out:
        write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
