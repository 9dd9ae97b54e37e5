"""Fault rules (``faults:`` in the app's config): validation, selection, the per-request draw."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from engine.params import client_request_id, unique_request_id
from kv_transport.base import KVTransferError
from kv_transport.faults import NO_FAULTS, FaultPoints, FaultRule


def test_rules_are_checked_naming_what_is_wrong():
    cases = [
        ({"point": "fetch", "action": "drop"}, "action 'drop' applies to point 'release' only"),
        ({"point": "mid_decode", "action": "fail"}, "applies to transport points only"),
        ({"point": "fetch", "action": "delay"}, "action 'delay' needs seconds > 0"),
        ({"point": "fetch", "action": "fail", "layer": 3}, "layer applies to point 'push_layer' only"),
        ({"point": "release", "action": "fail"}, "point 'release' takes action 'drop' or 'crash'"),
        ({"point": "fetch", "action": "fail", "probability": 1.5}, "less than or equal to 1"),
        ({"point": "nowhere", "action": "fail"}, "Input should be 'export'"),
    ]
    for rule, message in cases:
        with pytest.raises(ValidationError, match=message):
            FaultRule.model_validate(rule)


def test_a_probability_is_drawn_once_per_request_and_is_reproducible():
    points = FaultPoints([FaultRule(point="push_layer", action="fail", probability=0.05)])
    ids = [f"r{i}" for i in range(4000)]
    hit = [rid for rid in ids if points.selected("push_layer", rid, layer=0)]
    assert 0.035 < len(hit) / len(ids) < 0.065  # about 5% of requests
    # the same requests at every layer: a request's transfer fails whole or not at all
    assert all(points.selected("push_layer", rid, layer=layer) for rid in hit[:20] for layer in range(30))
    again = FaultPoints([FaultRule(point="push_layer", action="fail", probability=0.05)])
    assert [rid for rid in ids if again.selected("push_layer", rid, layer=0)] == hit
    # a client's id made unique on the engines draws as the id it chose, with its choice and retry suffixes
    for client_id, suffix in [("r7", ""), ("a.deadbeef", "-1"), ("r9", "-0-retry")]:
        engine_id = unique_request_id(client_id) + suffix
        assert engine_id != client_id + suffix and client_request_id(engine_id) == client_id + suffix
    unique = [unique_request_id(rid) for rid in ids]
    assert [rid for rid, uid in zip(ids, unique) if points.selected("push_layer", uid, layer=0)] == hit


def test_prefix_layer_and_actions():
    rules = [
        FaultRule(point="fetch", action="fail", request_id_prefix="bad-"),
        FaultRule(point="push_layer", action="fail", layer=2),
        FaultRule(point="release", action="drop", request_id_prefix="quiet-"),
        FaultRule(point="fetch", action="delay", seconds=0.01, request_id_prefix="slow-"),
    ]
    points = FaultPoints(rules)
    with pytest.raises(KVTransferError, match="injected failure at fetch"):
        asyncio.run(points.hit_async("fetch", "bad-1", "peer"))
    asyncio.run(points.hit_async("fetch", "good-1", "peer"))  # not selected
    asyncio.run(points.hit_async("fetch", "slow-1", "peer"))  # delayed only
    points.hit("push_layer", "any", "peer", layer=1)
    with pytest.raises(KVTransferError, match="push_layer"):
        points.hit("push_layer", "any", "peer", layer=2)
    assert points.drops("release", "quiet-1") and not points.drops("release", "loud-1")
    assert not NO_FAULTS and points


def test_cut_delays_ends_the_delays_in_progress_and_later_ones():
    """An hour's delay on the event loop and one on a thread both end when the rules are cut,
    and a delay hit after the cut does not wait; each is bounded here only against a hang."""
    points = FaultPoints([FaultRule(point="fetch", action="delay", seconds=3600)])

    async def scenario() -> None:
        on_loop = asyncio.ensure_future(points.hit_async("fetch", "r-1", "peer"))
        on_thread = asyncio.ensure_future(asyncio.to_thread(points.hit, "fetch", "r-2", "peer"))
        await asyncio.sleep(0)
        assert points._waking and not on_loop.done()  # waiting
        points.cut_delays()
        await asyncio.wait_for(asyncio.gather(on_loop, on_thread), 60)
        await asyncio.wait_for(points.hit_async("fetch", "r-3", "peer"), 60)
        assert not points._waking

    asyncio.run(scenario())


def test_a_crash_asks_its_gate_first():
    asked = []

    def gate(index: int, rule: FaultRule) -> bool:
        asked.append((index, rule.point))
        return False  # its max_times used up: no crash

    points = FaultPoints([FaultRule(point="mid_decode", action="crash")], crash_gate=gate)
    points.hit("mid_decode", "r", "peer")  # would have ended this process
    assert asked == [(0, "mid_decode")]


def test_crash_due_takes_the_gate_s_slot_and_is_false_once_max_times_is_used_up():
    slots = [True, False]  # one crash left, then none
    points = FaultPoints(
        [FaultRule(point="after_push", action="crash", request_id_prefix="kill-")], crash_gate=lambda i, r: slots.pop(0)
    )
    assert not points.crash_due("after_push", "other-1") and slots == [True, False]  # not selected: gate not asked
    assert points.crash_due("after_push", "kill-1") and slots == [False]
    assert not points.crash_due("after_push", "kill-2") and slots == []  # used up: the caller waits for nothing
    assert not NO_FAULTS.crash_due("after_push", "kill-3")


def test_of_builds_rules_for_every_request():
    points = FaultPoints.of({"fetch": 0.5}, ["push_layer"], drop_release=True)
    assert [(r.point, r.action) for r in points.rules] == [
        ("fetch", "delay"),
        ("push_layer", "fail"),
        ("release", "drop"),
    ]
