"""Prefix-aware routing on plain replicas with routing stats (as Serve holds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deployments.prefix_routing import PrefixAffinity, load_bound, prompt_keys
from deployments.router import RoutingStats, rank_replicas, with_affinity
from engine.params import Role


@dataclass
class Replica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


def _replicas(**running: int) -> list[Replica]:
    return [
        Replica(name, RoutingStats(Role.PREFILL, free_blocks=100, total_blocks=100, running=n, waiting=0).to_dict())
        for name, n in running.items()
    ]


def _route(affinity: PrefixAffinity, prompt: list[int], **running: int) -> str:
    ranks = with_affinity(rank_replicas(_replicas(**running), "prefill"), prompt_keys(prompt), affinity)
    return ranks[0][0].replica_id


CONVERSATION = list(range(1000, 1400))  # 25 full blocks


def test_a_prompt_goes_where_its_prefix_went_while_that_replica_is_within_the_bound():
    affinity = PrefixAffinity()
    assert _route(affinity, CONVERSATION, a=1, b=0) == "b"  # new prefix: least loaded, as before
    follow_up = CONVERSATION + list(range(5000, 5200))  # turn 2 carries turn 1 as its prefix
    assert _route(affinity, follow_up, a=0, b=1) == "b"  # b holds it, though a is idler
    assert affinity.hits == 1
    assert _route(affinity, follow_up, a=0, b=4) == "a"  # b over ceil(1.25 * 5 / 2) = 4: by load
    assert _route(affinity, follow_up + [7] * 16, a=1, b=0) == "a"  # remembered where it went last


def test_prompts_without_a_shared_prefix_route_by_load():
    affinity = PrefixAffinity()
    prompts = [list(range(i * 1000, i * 1000 + 64)) for i in range(4)]
    assert [_route(affinity, p, a=i, b=3 - i) for i, p in enumerate(prompts)] == ["a", "a", "b", "b"]
    assert affinity.hits == 0
    assert _route(affinity, [1, 2, 3], a=1, b=0) == "b"  # shorter than a block: no key at all


def test_one_hot_prefix_spreads_over_replicas_by_the_bound():
    affinity, running = PrefixAffinity(), {"a": 0, "b": 0, "c": 0}
    for _ in range(12):  # 12 requests with the same prompt, none finishing
        chosen = _route(affinity, CONVERSATION, **running)
        running[chosen] += 1
    # every replica takes a share, none more than 1.25x the mean (4)
    assert min(running.values()) >= 3 and max(running.values()) <= 5 == load_bound([4, 4, 3])


def test_the_memory_is_bounded():
    affinity = PrefixAffinity(max_keys=30)
    affinity.remember(prompt_keys(CONVERSATION), "a")  # 25 keys
    affinity.remember(prompt_keys(list(range(9000, 9160))), "b")  # 10 more: the oldest 5 go
    assert len(affinity._replica_of) == 30
