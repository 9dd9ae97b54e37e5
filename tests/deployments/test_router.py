"""The role-aware ranking, on plain objects with routing stats."""

from dataclasses import dataclass, field

from deployments.router import rank_replicas


@dataclass
class Replica:
    name: str
    routing_stats: dict = field(default_factory=dict)


def _names(ranks):
    return [r.name for rank in ranks for r in rank]


def test_calls_go_only_to_replicas_in_a_fitting_role():
    replicas = [
        Replica("p", {"role": "prefill", "waiting": 0, "running": 0, "free_blocks": 10}),
        Replica("d", {"role": "decode", "waiting": 0, "running": 5, "free_blocks": 3}),
        Replica("flipped", {"role": "decode", "waiting": 0, "running": 1, "free_blocks": 9}),
        Replica("b", {"role": "both", "waiting": 2, "running": 0, "free_blocks": 10}),
    ]
    assert _names(rank_replicas(replicas, "prefill")) == ["p", "b"]
    assert _names(rank_replicas(replicas, "decode_pull")) == ["flipped", "d", "b"]
    assert _names(rank_replicas(replicas, "stats")) == ["p", "flipped", "d", "b"]


def test_ties_broken_by_free_blocks_and_unknown_roles_accepted():
    replicas = [
        Replica("few", {"role": "decode", "free_blocks": 2}),
        Replica("many", {"role": "decode", "free_blocks": 20}),
        Replica("new", {}),
    ]
    assert _names(rank_replicas(replicas, "generate")) == ["many", "few", "new"]
