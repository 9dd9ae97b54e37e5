"""Prompt placement (conditional disaggregation by load) and the lent pool's share of whole requests.

Under the default policy a prompt moves to a decode replica once its predicted prefill TTFT
reaches 1.0 x 3000 ms = 3 s, while the decode TPOT p90 is below 0.8 x 120 ms = 96 ms, the
decode KV usage below 0.8, and no decode replica already prefills a prompt.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoscaling.placement import (
    Placement,
    PromptLoad,
    decode_heavy,
    place_prompt,
    predicted_prefill_ttft_s,
    prefer_lent,
)
from autoscaling.policy import Policy, load_policy

DEFAULT = load_policy("default")

# 4000 tokens queued at the one prefill replica + this prompt's 500, at 1 ms a token: 4.5 s
QUEUED = PromptLoad(
    prompt_tokens=500,
    prefill_tokens_in_flight=4000,
    prefill_replicas=1,
    decode_prompts_in_flight=0,
    decode_replicas=1,
    seconds_per_prompt_token=0.001,
    tpot_p90_s=0.05,
    decode_kv_usage=0.3,
)


def _with_placement(policy: Policy, **fields: object) -> Policy:
    return policy.model_copy(update={"prompt_placement": policy.prompt_placement.model_copy(update=fields)})


def test_a_queued_prefill_pool_sends_the_prompt_to_decode():
    assert predicted_prefill_ttft_s(QUEUED) == pytest.approx(4.5)
    assert place_prompt(QUEUED, DEFAULT) == Placement(True, "predicted prefill TTFT 4.50s >= 3.00s, decode has room")


def test_a_short_queue_keeps_the_prompt_at_prefill():
    load = replace(QUEUED, prefill_tokens_in_flight=1000)  # 1.5 s
    assert place_prompt(load, DEFAULT) == Placement(False, "predicted prefill TTFT 1.50s < 3.00s")


def test_the_queue_is_shared_by_the_prefill_replicas():
    load = replace(QUEUED, prefill_replicas=4)  # 1000 queued each + 500: 1.5 s
    assert predicted_prefill_ttft_s(load) == pytest.approx(1.5)
    assert not place_prompt(load, DEFAULT).on_decode


def test_latency_first_offloads_earlier():
    load = replace(QUEUED, prefill_tokens_in_flight=1000)  # 1.5 s: above 0.6 x 2000 ms, below 2.4 s
    placement = place_prompt(load, load_policy("latency_first"))
    assert placement == Placement(True, "predicted prefill TTFT 1.50s >= 1.20s, decode has room")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            {"tpot_p90_s": 0.085, "decode_min_output_tokens": 32},
            "decode TPOT p90 85ms + 0.50s stall over 32 tokens leaves no room",
        ),
        (
            {"tpot_p90_s": 0.05, "decode_min_output_tokens": 5},
            "decode TPOT p90 50ms + 0.50s stall over 5 tokens leaves no room",
        ),
        ({"tpot_p90_s": None, "decode_min_output_tokens": 32}, "decode TPOT not observed yet"),
        ({"decode_kv_usage": 0.85}, "decode KV usage 0.85 leaves no room"),
        ({"decode_prompts_in_flight": 1}, "1 prompts already prefilling on decode"),
        ({"decode_prompts_in_flight": 2, "decode_replicas": 2}, "2 prompts already prefilling on decode"),
        ({"seconds_per_prompt_token": None}, "prefill speed not measured yet"),
        ({"decode_replicas": 0}, "prompt placement off"),
        ({"prefill_replicas": 0}, "no prefill replica reported yet"),
        # one long prompt and no queue: no faster on a decode replica
        ({"prompt_tokens": 3000, "prefill_tokens_in_flight": 0}, "no faster on decode"),
    ],
    ids=[
        "tpot-no-room",
        "short-outputs-no-room",
        "tpot-unobserved",
        "kv-no-room",
        "max-prompts",
        "max-prompts-2-replicas",
        "speed-unknown",
        "no-decode",
        "no-prefill-known",
        "no-gain",
    ],
)
def test_the_prompt_stays_at_prefill_and_the_reason_says_why(change, reason):
    assert place_prompt(replace(QUEUED, **change), DEFAULT) == Placement(False, reason)


def test_placement_disabled_by_the_policy():
    assert place_prompt(QUEUED, _with_placement(DEFAULT, enabled=False)) == Placement(False, "prompt placement off")


def test_more_prompts_per_decode_replica_when_the_policy_allows():
    load = replace(QUEUED, decode_prompts_in_flight=1, decode_replicas=2)
    assert place_prompt(load, DEFAULT).on_decode  # 1 of 2 replicas busy with a prompt
    load = replace(QUEUED, decode_prompts_in_flight=1)
    assert not place_prompt(load, DEFAULT).on_decode
    assert place_prompt(load, _with_placement(DEFAULT, max_prompts_per_replica=2)).on_decode


def test_unmeasured_decode_latency_and_kv_do_not_block_an_idle_decode_pool():
    load = replace(QUEUED, tpot_p90_s=None, decode_kv_usage=None)
    assert place_prompt(load, DEFAULT).on_decode


def test_the_stall_fits_the_tpot_room_of_long_outputs():
    # 50 ms + 0.5 s / 199 tokens = 52.5 ms < 96 ms: the long decodes absorb the stall
    assert place_prompt(replace(QUEUED, decode_min_output_tokens=200), DEFAULT).on_decode
    # 94 ms + 0.5 s / 199 = 96.5 ms: just over the room
    assert not place_prompt(replace(QUEUED, tpot_p90_s=0.094, decode_min_output_tokens=200), DEFAULT).on_decode


def test_tpot_just_under_the_room_still_offloads():
    assert place_prompt(replace(QUEUED, tpot_p90_s=0.095), DEFAULT).on_decode
    assert place_prompt(replace(QUEUED, decode_kv_usage=0.79), DEFAULT).on_decode


@pytest.mark.parametrize(
    ("decode_in_flight", "decode_replicas", "lent_in_flight", "lent_replicas", "expected"),
    [
        (4, 1, 1, 1, True),  # the lent replica is less busy
        (2, 1, 2, 1, False),  # as busy: the decode pool keeps it
        (6, 2, 4, 1, False),  # 4 per lent replica against 3 per decode replica
        (6, 2, 2, 1, True),  # 2 against 3
        (9, 1, 0, 0, False),  # nothing lent
        (0, 0, 5, 1, True),  # no decode replica
    ],
)
def test_prefer_lent_compares_requests_per_replica(
    decode_in_flight, decode_replicas, lent_in_flight, lent_replicas, expected
):
    assert prefer_lent(decode_in_flight, decode_replicas, lent_in_flight, lent_replicas) is expected


def test_only_decode_heavy_requests_go_whole_to_a_lent_replica():
    assert decode_heavy(prompt_tokens=48, output_tokens=200)
    assert decode_heavy(prompt_tokens=64, output_tokens=64)
    assert not decode_heavy(prompt_tokens=400, output_tokens=32)
