"""The role-aware ranking, on plain objects with routing stats (as Serve holds them: dicts)."""

from dataclasses import dataclass, field

from deployments.router import RoutingStats, parse_routing_stats, rank_replicas
from engine.params import EngineStats, Role


@dataclass
class Replica:
    name: str
    routing_stats: dict = field(default_factory=dict)


def _stats(role: Role, waiting: int = 0, running: int = 0, free_blocks: int = 0) -> dict:
    stats = RoutingStats(role=role, free_blocks=free_blocks, total_blocks=32, running=running, waiting=waiting)
    return stats.to_dict()


def _names(ranks):
    return [r.name for rank in ranks for r in rank]


def test_calls_go_only_to_replicas_in_a_fitting_role():
    replicas = [
        Replica("p", _stats(Role.PREFILL, waiting=0, running=0, free_blocks=10)),
        Replica("d", _stats(Role.DECODE, waiting=0, running=5, free_blocks=3)),
        Replica("flipped", _stats(Role.DECODE, waiting=0, running=1, free_blocks=9)),
        Replica("b", _stats(Role.BOTH, waiting=2, running=0, free_blocks=10)),
    ]
    assert _names(rank_replicas(replicas, "prefill")) == ["p", "b"]
    assert _names(rank_replicas(replicas, "decode_pull")) == ["flipped", "d", "b"]
    assert _names(rank_replicas(replicas, "stats")) == ["p", "flipped", "d", "b"]


def test_ties_broken_by_free_blocks_and_unknown_roles_accepted():
    replicas = [
        Replica("few", _stats(Role.DECODE, free_blocks=2)),
        Replica("many", _stats(Role.DECODE, free_blocks=20)),
        Replica("new", {}),
    ]
    assert _names(rank_replicas(replicas, "generate")) == ["many", "few", "new"]


def test_routing_stats_travel_as_plain_data_and_parse_back():
    engine_stats = EngineStats(
        role=Role.DECODE,
        num_total_blocks=32,
        num_free_blocks=7,
        num_pinned_blocks=0,
        num_reserved_blocks=4,
        num_running=3,
        num_waiting=1,
        block_size=16,
        num_preemptions=0,
        median_step_ms=0.0,
    )
    wire = RoutingStats.of(engine_stats).to_dict()
    assert wire == {"role": "decode", "free_blocks": 7, "total_blocks": 32, "running": 3, "waiting": 1}
    assert type(wire["role"]) is str  # Serve's controller need not import engine.params
    assert parse_routing_stats(wire) == RoutingStats(
        role=Role.DECODE, free_blocks=7, total_blocks=32, running=3, waiting=1
    )
    assert parse_routing_stats({}) is None


def test_every_replica_is_ranked_when_none_reports_the_wanted_role():
    # "p2" was just lent (role both), its report still says prefill: the engines admit or refuse
    replicas = [
        Replica("p1", _stats(Role.PREFILL, waiting=1)),
        Replica("p2", _stats(Role.PREFILL, running=3)),
        Replica("p3", _stats(Role.PREFILL, free_blocks=5)),
    ]
    assert _names(rank_replicas(replicas, "decode_pull")) == ["p3", "p2", "p1"]
    assert _names(rank_replicas(replicas, "generate")) == ["p3", "p2", "p1"]
    decode_only = [Replica("d1", _stats(Role.DECODE, running=2)), Replica("d2", _stats(Role.DECODE))]
    assert _names(rank_replicas(decode_only, "prefill")) == ["d2", "d1"]
    # once one reports the wanted role (or both), only those are ranked
    replicas[1] = Replica("p2", _stats(Role.BOTH, running=3))
    assert _names(rank_replicas(replicas, "decode_pull")) == ["p2"]
    assert _names(rank_replicas([*replicas, Replica("d", _stats(Role.DECODE, waiting=4))], "generate")) == ["p2", "d"]
