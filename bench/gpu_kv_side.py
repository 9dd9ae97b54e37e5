"""The two processes of ``bench.gpu_kv`` and what they share, no Ray.

Each process holds one engine's KV pool (``engine.kv_pool.KVPool``, on the GPU or on CPU
memory) with two ``NixlTransport``s over it, one moving the pool's own memory and one staging
through a pinned host buffer (``staging="host"``, engine id ``<role>-staged``), and a bare NIXL
agent with one contiguous buffer for the raw READ. Commands name the transport by its
``staging`` ("none" or "host"). The parent drives both over a ``multiprocessing`` Pipe: ``(command,
args)`` in, ``("ok", result)`` or ``("error", text)`` out. The transports find each other
through ``SharedDictRegistry``: a ``multiprocessing.Manager`` dict that carries each
engine's ``PeerInfo`` (its NIXL agents' metadata and pool address) between the processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import threading
import time
import traceback
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch

from engine.host_memory import host_tensor
from engine.kv_pool import KVLayout, KVPool
from kv_transport.base import LayerTiming
from kv_transport.handle import KVDestination, KVHandle
from kv_transport.nixl_transport import NixlTransport
from kv_transport.registry import BasePeerRegistry, PeerInfo

PRODUCER, CONSUMER = "producer", "consumer"  # the engine ids of the two processes' unstaged transports
PATTERN_SEED = 1234
RAW_PROGRESS_S = 0.001  # the raw agents' progress on the side being read, as bench.kv_transfer's


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
    num_staged_repeats: int = 5  # timed staged pulls per size (each export holds its slots until fetched)
    staging_bytes: int = 1 << 30  # each staging transport's pinned buffer

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device == "cuda" else "DRAM"

    def blocks_for(self, size_mb: float) -> int:
        return max(1, round(size_mb * 2**20 / self.layout.bytes_per_block))

    @property
    def pool_blocks(self) -> int:
        return max(self.push_blocks, *(self.blocks_for(size) for size in self.sizes_mb)) + 8

    @property
    def raw_bytes(self) -> int:
        """The raw agents' buffer: twice the largest size, so a READ split into pieces can
        leave a gap after each (pieces that touch might be merged on the way)."""
        return 2 * max(self.blocks_for(size) for size in self.sizes_mb) * self.layout.bytes_per_block


@dataclass(frozen=True)
class BandwidthResult:
    """One size, seconds per transfer of the same bytes, the kinds taking turns (the first of
    each warms up): raw READs as one descriptor and as our pull's count of descriptors, and
    our pulls."""

    num_bytes: int
    num_descriptors: int  # of our pull
    raw_s: tuple[float, ...]
    raw_split_s: tuple[float, ...]
    pull_s: tuple[float, ...]
    bytes_ok: bool  # the first pull's blocks equal the producer's


@dataclass(frozen=True)
class PushRun:
    """One push: NixlTransport's layer timings (its ``compute_end`` is when ``push_layer`` was
    called on the host) and when each layer's simulated forward really ended (unix s; on CUDA
    from the layer's event on the compute stream)."""

    layer_times: tuple[LayerTiming, ...]
    compute_end: tuple[float, ...]
    num_bytes: int


class SharedDictRegistry(BasePeerRegistry):
    """Peer entries in a ``multiprocessing.Manager`` dict, seen by every process holding the
    proxy. Entries go in pickled, so the manager's process needs none of these types."""

    def __init__(self, entries: MutableMapping[str, bytes]) -> None:
        self._entries = entries

    def publish(self, info: PeerInfo) -> None:
        self._entries[info.engine_id] = pickle.dumps(info)

    def remove(self, engine_id: str, incarnation: str) -> None:
        current = self.current(engine_id)
        if current is not None and current.incarnation == incarnation:
            self._entries.pop(engine_id, None)

    def current(self, engine_id: str) -> PeerInfo | None:
        raw = self._entries.get(engine_id)
        return pickle.loads(raw) if raw else None


def child_main(role: str, plan: Plan, entries: MutableMapping[str, bytes], conn, log_path: str) -> None:
    """One process of the pair: answer the parent's commands until ``close`` or a closed pipe.
    Its stdout and stderr (UCX's protocol tables among them) go to ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        side = _Side(role, plan, entries)
    except Exception as exc:
        conn.send(("error", _describe(exc)))
        return
    conn.send(("ok", None))
    loop = asyncio.new_event_loop()
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            break
        try:
            result = getattr(side, command)(*args)
            if asyncio.iscoroutine(result):
                result = loop.run_until_complete(result)
        except Exception as exc:
            conn.send(("error", _describe(exc)))
            continue
        conn.send(("ok", result))
        if command == "close":
            break


def _describe(exc: BaseException) -> str:
    traceback.print_exc()  # the whole story into the log; the parent gets one line
    return f"{type(exc).__name__}: {exc}"


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


class _Side:
    """One engine's pool with a NixlTransport over it, and a bare NIXL agent."""

    def __init__(self, role: str, plan: Plan, entries: MutableMapping[str, bytes]) -> None:
        self.plan = plan
        if plan.device == "cuda":
            torch.cuda.set_device(0)
        self.pool = KVPool(plan.layout, plan.pool_blocks, plan.device).tensor
        if role == PRODUCER:
            self.pool.copy_(_pattern(plan))
        _synchronize(plan)  # written before anyone reads it
        self.released: list[str] = []
        registry = SharedDictRegistry(entries)
        staged = {"staging": "host", "staging_bytes": plan.staging_bytes}
        self.transports = {  # staging "none" and "host"
            kind: NixlTransport(name, plan.layout, registry, kv_transfer_timeout_s=plan.kv_transfer_timeout_s, **extra)
            for kind, name, extra in (("none", role, {}), ("host", f"{role}-staged", staged))
        }
        for transport in self.transports.values():  # the same pool under both
            transport.register_pool(self.pool, self.released.append)
        self.raw = _RawAgent(f"raw-{role}", plan)
        self.compute = _LayerCompute(plan) if role == PRODUCER else None

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()

    def raw_meta(self) -> tuple[bytes, int, int]:
        return self.raw.meta()

    def _tail_blocks(self, count: int) -> list[int]:
        return list(range(self.plan.pool_blocks - count, self.plan.pool_blocks))

    def _matches(self, local: list[int], remote: list[int]) -> bool:
        return torch.equal(self.pool[:, :, local], _pattern(self.plan)[:, :, remote])

    # ---- producer ---------------------------------------------------------------------

    def export(self, num_blocks: int, count: int, tag: str, staging: str = "none") -> list[KVHandle]:
        tokens = num_blocks * self.plan.layout.block_size
        transport = self.transports[staging]
        return [transport.export(f"{tag}-{i}", list(range(num_blocks)), tokens, 1) for i in range(count)]

    async def push(self, destination: KVDestination, staging: str = "none") -> PushRun:
        """Push every layer right after its simulated forward, as the engine's layer hook does."""
        request_id = destination.request_id
        blocks = list(range(len(destination.block_ids)))
        transport = self.transports[staging]
        transport.begin_push(destination)
        self.compute.start()
        for layer in range(self.plan.layout.num_layers):
            with self.compute.layer():  # on CUDA push_layer records its event on the compute stream
                transport.push_layer(request_id, layer, blocks, 0)
        stats = await transport.finish_push(request_id, first_token=1)
        return PushRun(stats.layer_times, self.compute.ends(), stats.num_bytes)

    # ---- consumer ---------------------------------------------------------------------

    async def bandwidth(
        self, handles: list[KVHandle], raw_peer: tuple, num_bytes: int, num_pieces: int, staging: str = "none"
    ) -> BandwidthResult:
        """Our pull of each handle, a raw READ of the same bytes and one split into
        ``num_pieces`` descriptors, each round starting with the next kind. Staged pulls
        (``staging="host"``) alone: no raw READs (their rows are the unstaged table's)."""
        local = self._tail_blocks(len(handles[0].block_ids))
        self.pool[:, :, local] = 0
        _synchronize(self.plan)
        times: dict[str, list[float]] = {"raw": [], "raw_split": [], "pull": []}
        kinds = list(times) if staging == "none" else ["pull"]
        transport = self.transports[staging]
        num_descriptors, bytes_ok = 0, False
        for i, handle in enumerate(handles):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                if kind != "pull":
                    times[kind].append(self.raw.read_s(raw_peer, num_bytes, num_pieces if kind == "raw_split" else 1))
                    continue
                start = time.perf_counter()
                stats = await transport.fetch(handle, local)
                times["pull"].append(time.perf_counter() - start)
                if i == 0:
                    num_descriptors, bytes_ok = stats.num_descriptors, self._matches(local, handle.block_ids)
        return BandwidthResult(
            num_bytes, num_descriptors, *(tuple(times[k]) for k in ("raw", "raw_split", "pull")), bytes_ok
        )

    def destination(self, request_id: str, num_blocks: int, staging: str = "none") -> KVDestination:
        blocks = self._tail_blocks(num_blocks)
        self.pool[:, :, blocks] = 0  # so the check after the push sees its bytes, not an earlier pull's
        _synchronize(self.plan)
        return self.transports[staging].destination(request_id, blocks, num_blocks * self.plan.layout.block_size)

    async def wait_push(
        self, destination: KVDestination, verify: bool, staging: str = "none"
    ) -> tuple[float, bool | None]:
        """When the completion notice arrived (unix s; staged: once copied into the pool too)
        and, if asked, whether the bytes did."""
        await self.transports[staging].wait_push(destination)
        seen = time.time()
        if not verify:
            return seen, None
        return seen, self._matches(destination.block_ids, list(range(len(destination.block_ids))))


class _LayerCompute:
    """A layer's forward of known duration, and when each ended: on CUDA a GPU sleep on a
    compute stream with an event after it (read back as unix time from a reference event),
    on CPU a host sleep."""

    def __init__(self, plan: Plan) -> None:
        self.seconds = plan.compute_ms / 1e3
        self.cuda = plan.device == "cuda"
        self._ends: list[float] = []
        self._events: list = []
        if self.cuda:
            self.stream = torch.cuda.Stream()
            self.cycles = int(self.seconds * _sleep_cycles_per_s())

    def start(self) -> None:
        self._ends, self._events = [], []
        if self.cuda:
            torch.cuda.synchronize()
            # read before the reference event runs: the ends come out late by the launch
            # latency, never early, so a tail measured from them is never too short
            self._origin_unix = time.time()
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record(self.stream)

    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        if not self.cuda:
            time.sleep(self.seconds)
            self._ends.append(time.time())
            yield
            return
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(self.cycles)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
            yield

    def ends(self) -> tuple[float, ...]:
        if not self.cuda:
            return tuple(self._ends)
        torch.cuda.synchronize()
        return tuple(self._origin_unix + self._origin.elapsed_time(e) / 1e3 for e in self._events)


def _sleep_cycles_per_s() -> float:
    """``torch.cuda._sleep`` spins for a number of GPU cycles: how many make a second."""
    torch.cuda._sleep(100_000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


class _RawAgent:
    """A bare NIXL agent made as ``NixlWorker`` makes its data agent (UCX, no NIXL progress
    thread) and one contiguous buffer: the raw READ our pull is measured against."""

    def __init__(self, name: str, plan: Plan) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if plan.device == "cuda":
            self.buffer = torch.ones(plan.raw_bytes, dtype=torch.uint8, device="cuda")
        else:  # memory as the CPU pool's (2 MB pages), so the two compare on the same pages
            self.buffer = host_tensor((plan.raw_bytes,), torch.uint8).fill_(1)
        self.mem_type = plan.mem_type
        self.device_id = max(self.buffer.get_device(), 0)
        self.agent.register_memory(self.buffer)
        self.lock = threading.Lock()
        self._peers: dict[bytes, str] = {}
        threading.Thread(target=self._progress, args=(plan.device,), daemon=True).start()

    def _progress(self, device: str) -> None:
        """Progress UCX on the side being read (connection set-up needs its answers)."""
        if device == "cuda":  # the GPU's primary context current in this thread (as ``NixlWorker.bind_cuda``)
            torch.cuda.set_device(0)
            torch.cuda.current_stream().query()
        while True:
            with self.lock:
                self.agent.get_new_notifs()
            time.sleep(RAW_PROGRESS_S)

    def meta(self) -> tuple[bytes, int, int]:
        return self.agent.get_agent_metadata(), self.buffer.data_ptr(), self.device_id

    def read_s(self, peer: tuple[bytes, int, int], num_bytes: int, num_pieces: int = 1) -> float:
        """One READ of ``num_bytes`` as ``num_pieces`` equal descriptors with a gap after each,
        its completion polled in a tight loop."""
        metadata, address, device = peer
        with self.lock:
            if metadata not in self._peers:
                self._peers[metadata] = self.agent.add_remote_agent(metadata)
            name = self._peers[metadata]
        piece = num_bytes // num_pieces
        offsets = [2 * piece * k for k in range(num_pieces)]
        base = self.buffer.data_ptr()
        local = self.agent.get_xfer_descs([(base + o, piece, self.device_id) for o in offsets], self.mem_type)
        remote = self.agent.get_xfer_descs([(address + o, piece, device) for o in offsets], self.mem_type)
        start = time.perf_counter()
        with self.lock:
            handle = self.agent.initialize_xfer("READ", local, remote, name)
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - start
            self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return elapsed
