"""The two ends of a KV transfer benchmark, no Ray: a ``KVSide`` holds one engine's KV pool, transports
over it and a bare NIXL agent for the raw READ. ``bench.kv_transfer`` runs one as a Ray actor;
``bench.gpu_kv`` one per one-worker process pool, with two ``NixlTransport``s (``staging`` "none" and
"host") that find each other through a ``multiprocessing.Manager`` dict."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch

from engine.host_memory import host_tensor
from engine.kv_pool import KVLayout, KVPool
from kv_transport.base import BaseKVTransport, LayerTiming
from kv_transport.handle import KVDestination, KVHandle
from kv_transport.nixl_transport import NixlTransport
from kv_transport.registry import LocalPeerRegistry, PeerInfo

PRODUCER, CONSUMER = "producer", "consumer"  # the engine ids of the two processes' unstaged transports
PATTERN_SEED = 1234
RAW_PROGRESS_S = 0.001  # the raw agents' progress on the side being read


@dataclass(frozen=True)
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

    def blocks_for(self, size_mb: float) -> int:
        return max(1, round(size_mb * 2**20 / self.layout.bytes_per_block))

    @property
    def pool_blocks(self) -> int:
        return max(self.push_blocks, *(self.blocks_for(size) for size in self.sizes_mb)) + 8

    @property
    def raw_bytes(self) -> int:
        """Twice the largest size: a READ split into pieces leaves a gap after each (or they might merge)."""
        return 2 * max(self.blocks_for(size) for size in self.sizes_mb) * self.layout.bytes_per_block


@dataclass(frozen=True)
class BandwidthResult:
    """Seconds per transfer of one size by kind ("raw", "raw_split", "pull"), the first a warm-up."""

    times: dict[str, tuple[float, ...]]
    num_descriptors: int  # of our pull
    bytes_ok: bool  # the first pull's blocks equal the producer's


@dataclass(frozen=True)
class PushRun:
    """The transport's layer timings (``compute_end``: ``push_layer``'s call) and each forward's real end (unix s)."""

    layer_times: tuple[LayerTiming, ...]
    compute_end: tuple[float, ...]
    num_bytes: int


class SharedDictRegistry(LocalPeerRegistry):
    """``LocalPeerRegistry``'s rules over a ``multiprocessing.Manager`` dict, which every process shares."""

    def __init__(self, entries: MutableMapping[str, PeerInfo]) -> None:
        self._entries = entries


_WORKER: dict = {}  # this worker process's side and event loop (``side_call``'s state)


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


def _synchronize(plan: Plan) -> None:
    """Wait for this process's kernels: UCX copies on its own streams, blind to torch's."""
    if plan.device == "cuda":
        torch.cuda.synchronize()


def _pattern(plan: Plan) -> torch.Tensor:
    """The producer's pool contents, reproducible in the consumer to check what arrived."""
    layout = plan.layout
    shape = (layout.num_layers, 2, plan.pool_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    generator = torch.Generator(device=plan.device).manual_seed(PATTERN_SEED)
    return torch.randn(shape, generator=generator, device=plan.device).to(getattr(torch, layout.dtype))


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
        transport, start = self.transports[kind], time.perf_counter()
        tokens = num_blocks * transport.layout.block_size
        handles = [transport.export(f"{tag}-{i}", list(range(num_blocks)), tokens, 1) for i in range(count)]
        return handles, time.perf_counter() - start

    async def wait_push(self, destination: KVDestination, kind: str) -> float:
        """When the push's completion notice arrived (unix s; staged: once copied into the pool too)."""
        await self.transports[kind].wait_push(destination)
        return time.time()


class _Side(KVSide):
    """``bench.gpu_kv``'s side: transports "none" and "host" (staged), the producer's pool a known pattern."""

    def __init__(self, role: str, plan: Plan, entries: MutableMapping[str, PeerInfo]) -> None:
        self.plan = plan
        if plan.device == "cuda":
            torch.cuda.set_device(0)
        pool = KVPool(plan.layout, plan.pool_blocks, plan.device).tensor
        if role == PRODUCER:
            pool.copy_(_pattern(plan))
        _synchronize(plan)  # written before anyone reads it
        registry, staged = SharedDictRegistry(entries), {"staging": "host", "staging_bytes": plan.staging_bytes}
        transports = {
            kind: NixlTransport(name, plan.layout, registry, kv_transfer_timeout_s=plan.kv_transfer_timeout_s, **extra)
            for kind, name, extra in (("none", role, {}), ("host", f"{role}-staged", staged))
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
        _synchronize(self.plan)
        return blocks

    def _matches(self, local: list[int], remote: list[int]) -> bool:
        return torch.equal(self.pool[:, :, local], _pattern(self.plan)[:, :, remote])

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
        return PushRun(stats.layer_times, self.compute.ends(), stats.num_bytes)

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
        """The notice's arrival and, if asked, whether the bytes arrived."""
        seen, blocks = await super().wait_push(destination, staging), destination.block_ids
        return seen, self._matches(blocks, list(range(len(blocks)))) if verify else None


class _LayerCompute:
    """Forwards of known duration and their ends: on CUDA a GPU sleep and an event after it, else a sleep."""

    def __init__(self, plan: Plan) -> None:
        self.seconds, self.cuda, self._ends = plan.compute_ms / 1e3, plan.device == "cuda", []
        if self.cuda:
            self.stream, self.cycles = torch.cuda.Stream(), int(self.seconds * _sleep_cycles_per_s())

    def start(self) -> None:
        self._ends = []
        if self.cuda:
            torch.cuda.synchronize()
            # read before the reference event runs: the ends come out late by the launch latency,
            # never early, so a tail measured from them is never too short
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


def _sleep_cycles_per_s() -> float:
    """``torch.cuda._sleep`` spins for a number of GPU cycles: how many make a second."""
    torch.cuda._sleep(100_000)  # warm-up
    start, end, cycles = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


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
