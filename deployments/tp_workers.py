"""A tensor-parallel replica's other ranks: Ray actors in the replica's placement group.

Serve gives a replica whose pool has ``tensor_parallel_size`` > 1 one placement group of that
many bundles, packed on one node (``deployments.build``); the replica is bundle 0 and rank 0,
and rank r runs ``engine.tp_worker.run_worker`` in an actor on bundle r (one GPU each on
GPUs). The actors are the replica's own: when the replica dies, Ray ends them with it, and
a rank that dies makes the replica's health check fail, so Serve replaces the whole group.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.loader import ModelSpec
from engine.tensor_parallel import Rendezvous
from engine.tp_worker import Launcher, RankExtension, run_worker


class _Rank:
    """One rank's actor: ``run`` lasts as long as the engine."""

    def run(self, spec: ModelSpec, config: EngineConfig, rank: int, rendezvous: Rendezvous, threads: int, extension):
        run_worker(spec, config, rank, rendezvous, threads, extension)


class RayWorkers:
    """Ranks 1 .. degree - 1 on bundles 1 .. of the calling replica's placement group."""

    def __init__(
        self,
        spec: ModelSpec,
        config: EngineConfig,
        rendezvous: Rendezvous,
        bundle: dict[str, float],
        threads: int,
        extension: RankExtension | None = None,
    ) -> None:
        """Outside a placement group (an engine a test or benchmark runs under Ray), plain actors
        of ``bundle``'s size on this node."""
        group = get_current_placement_group()
        remote = ray.remote(_Rank)
        self.actors = [
            remote.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), **_placement(group, rank))
            for rank in range(1, rendezvous.degree)
        ]
        self.actors = [options.remote() for options in self.actors]
        self._runs = [
            actor.run.remote(spec, config, rank, rendezvous, threads, extension)
            for rank, actor in enumerate(self.actors, 1)
        ]

    def problem(self) -> str | None:
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for ref in done:
            rank = self._runs.index(ref) + 1
            try:
                ray.get(ref)
                return f"tensor-parallel rank {rank} ended"
            except Exception as exc:  # the actor died or its run raised
                return f"tensor-parallel rank {rank} exited: {type(exc).__name__}: {exc}"
        return None

    def stop(self, grace_s: float) -> None:
        if grace_s > 0:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=grace_s)
        for actor in self.actors:
            ray.kill(actor)


def _placement(group: Any, rank: int) -> dict[str, Any]:
    if group is not None:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def ray_launcher(
    spec: ModelSpec, bundle: dict[str, Any], threads: int, extension: RankExtension | None = None
) -> Launcher:
    return lambda rendezvous, config: RayWorkers(spec, config, rendezvous, bundle, threads, extension)
