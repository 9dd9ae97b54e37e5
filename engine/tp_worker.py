"""The ranks of a tensor-parallel engine other than rank 0, and rank 0's side of the group.

``run_worker`` is one rank: it loads the model, keeps its shard (``engine.tensor_parallel``),
builds its own KV pool (its KV heads only, as many blocks as rank 0) and runs each plan rank 0
sends until rank 0 sends none. Where the ranks run is the launcher's business: ``LocalWorkers``
forks local processes (engines outside Serve: tests, benchmarks); a Serve replica starts them
as Ray actors in its placement group (``deployments.tp_workers``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.kv_pool import KVPool, layout_for
from engine.loader import ModelSpec, load_model
from engine.model_runner import ModelRunner
from engine.params import RankLostError
from engine.scheduler import ScheduledChunk
from engine.tensor_parallel import RankGroup, Rendezvous, leader, shard_for, shard_model

logger = logging.getLogger(__name__)
STOP_GRACE_S = 10.0  # how long the ranks may take to end after rank 0's stop


@dataclass(frozen=True)
class Step:
    """What rank 0 sends each time: a forward's plan, and commands every rank runs before it
    (a KV transfer into its own pool: ``RankExtension``), each answering an int (-1: failed)."""

    chunks: tuple[ScheduledChunk, ...] = ()
    commands: tuple[object, ...] = ()


class RankExtension(Protocol):
    """Work of a rank besides the forward (the KV transport's side of it), set up once the
    rank's runner exists; picklable, so it reaches ranks in other processes."""

    def start(self, runner: ModelRunner, group: RankGroup) -> Callable[[object], int]:
        """Set up; returns what runs each command (an int back to rank 0, e.g. bytes moved),
        closed (``close()``, where it has one) when the rank stops."""


class Workers(Protocol):
    """Ranks 1 .. degree - 1 of one engine, wherever they run."""

    def problem(self) -> str | None:
        """Why a rank is gone (None: all alive)."""

    def stop(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` in all for the ranks to end after rank 0's stop, then end what
        is left (0 when no stop was sent: the ranks wait for a plan that will not come)."""


# (rank 0's rendezvous, the settings every rank builds from) -> the started workers
Launcher = Callable[[Rendezvous, EngineConfig], Workers]


def build_rank(model: torch.nn.Module, config: EngineConfig, rank: int, group: RankGroup | None) -> ModelRunner:
    """One rank's runner: its shard of ``model`` (all of it without a group) over its own pool.
    ``config.num_blocks`` must be set (rank 0 resolves it and passes it on)."""
    degree = 1 if group is None else group.degree
    shard = None
    if rank:
        model.set_output_embeddings(None)  # the LM head runs on rank 0 only
    if group is not None:
        shard = shard_for(model.config, rank, degree)
        shard_model(model, shard, group.all_reduce)
    layout = layout_for(model.config, config.block_size, model.dtype, shard)
    pool = KVPool(layout, config.num_blocks, model.device)
    graphs = config.graph_batch_sizes() if degree == 1 else None  # graphs capture one rank's work only
    spec = config.speculative
    queries = spec.num_speculative_tokens + 1 if spec.enabled else 1
    return ModelRunner(
        model, pool, config.cpu_packed_weights, graphs, rank == 0, config.cuda_decode_kernels, verify_queries=queries
    )


def run_worker(
    spec: ModelSpec,
    config: EngineConfig,
    rank: int,
    rendezvous: Rendezvous,
    threads: int = 1,
    extension: RankExtension | None = None,
) -> None:
    """Rank ``rank`` of an engine: join the group, load, then run rank 0's steps until it stops."""
    torch.set_num_threads(threads)
    if spec.device.startswith("cuda") and torch.cuda.device_count() >= rendezvous.degree:
        torch.cuda.set_device(rank)  # local ranks see every GPU: one each (Ray gives an actor its own)
    group = RankGroup(rank, rendezvous, torch.device(spec.device))
    group.publish(f"pid/{rank}", str(os.getpid()))
    runner = run_command = None
    try:
        runner = build_rank(load_model(spec).model, config, rank, group)
        if extension is not None:
            run_command = extension.start(runner, group)
    except Exception:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        runner = None
    if group.agree(runner is not None) or runner is None:
        return
    try:
        while (step := group.receive()) is not None:
            for command in step.commands:
                group.gather(_run(run_command, command, rank))
            if step.chunks:
                runner.execute(step.chunks)
    finally:
        if hasattr(run_command, "close"):
            run_command.close()


def _run(run_command: Callable[[object], int] | None, command: object, rank: int) -> int:
    try:
        return run_command(command)
    except Exception:
        logger.exception("tensor-parallel rank %d: command %s failed", rank, type(command).__name__)
        return -1


class LocalWorkers:
    """Ranks 1 .. degree - 1 as processes of this machine, forked from a server process that
    imported the engine once (no state shared with rank 0, and a rank starts without importing
    torch again: a fresh process per rank took 6-12 s here)."""

    def __init__(
        self,
        spec: ModelSpec,
        config: EngineConfig,
        rendezvous: Rendezvous,
        threads: int = 1,
        extension: RankExtension | None = None,
    ) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # the server imports torch and the engine once
        self._processes = [
            context.Process(
                target=run_worker,
                args=(spec, config, rank, rendezvous, threads, extension),
                name=f"tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, rendezvous.degree)
        ]
        for process in self._processes:
            process.start()

    def problem(self) -> str | None:
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                return f"tensor-parallel rank {rank} exited (code {process.exitcode})"
        return None

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join()


def local_launcher(spec: ModelSpec, threads: int = 1, extension: RankExtension | None = None) -> Launcher:
    return lambda rendezvous, config: LocalWorkers(spec, config, rendezvous, threads, extension)


class Leader:
    """Rank 0's side: sends each plan, keeps the workers waiting while idle, notices a lost rank."""

    def __init__(self, device: torch.device, degree: int, config: EngineConfig, launch: Launcher) -> None:
        rendezvous, join = leader(degree, device)
        self.workers = launch(rendezvous, config)
        try:
            self.group = join(self.workers.problem)  # waits for every rank to connect
        except RuntimeError:
            self.workers.stop(grace_s=0.0)  # the others wait for a rank that will not join
            raise
        self.failure: str | None = None

    def ready(self, ok: bool) -> None:
        """After rank 0 built its own shard: every rank agrees, or this raises naming the others."""
        failed = self.group.agree(ok)
        if failed:
            self.close()
            raise RuntimeError(f"tensor-parallel ranks {failed} failed to start (their logs say why)")

    def send(self, plan: Sequence[ScheduledChunk]) -> None:
        self._send(Step(chunks=tuple(plan)))

    def command(self, command: object, own: Callable[[], int]) -> list[int]:
        """Every rank runs ``command`` (rank 0: ``own``); each rank's answer, by rank (-1: failed)."""
        self._send(Step(commands=(command,)))
        try:
            mine = own()
        except Exception:
            logger.exception("tensor-parallel rank 0: command %s failed", type(command).__name__)
            mine = -1
        try:
            return self.group.gather(mine)
        except Exception as exc:
            raise self.lost(exc) from exc

    def _send(self, step: Step) -> None:
        self._check()
        try:
            self.group.send(step)
        except Exception as exc:
            raise self.lost(exc) from exc

    def lost(self, exc: BaseException) -> RankLostError:
        """A collective failed: a rank is gone (or the group is out of step, which is as bad)."""
        self.failure = self.failure or self.workers.problem() or f"a tensor-parallel rank is gone: {exc}"
        return RankLostError(self.failure)

    def heartbeat(self) -> None:
        """An empty step (the engine is idle): the workers' wait starts over."""
        if self.failure is None:
            try:
                self._send(Step())
            except RankLostError:
                logger.error("%s", self.failure)

    def problem(self) -> str | None:
        return self.failure or self.workers.problem()

    @property
    def pids(self) -> list[int]:
        """Ranks 1.. 's process ids, by rank."""
        return [int(self.group.read(f"pid/{rank}")) for rank in range(1, self.group.degree)]

    def _check(self) -> None:
        problem = self.problem()
        if problem is not None:
            self.failure = problem
            raise RankLostError(problem)

    def close(self) -> None:
        grace_s = 0.0  # with a rank gone the others wait for a plan that will not come: end them
        if self.problem() is None:
            try:
                self.group.send(None)
                grace_s = STOP_GRACE_S
            except Exception:  # a rank went away meanwhile; stop() ends the rest
                logger.warning("a tensor-parallel rank did not take the stop")
        self.workers.stop(grace_s)
