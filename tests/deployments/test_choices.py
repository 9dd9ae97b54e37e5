"""``n`` > 1 and batched prompts at the ingress: one engine request per choice, each prompt's
choice 0 first, then the rest merged as they come; the OpenAI body with every choice and each
prompt counted once in the usage."""

from __future__ import annotations

import asyncio

import pytest

from deployments.ingress import choice_requests, merge_after_first
from deployments.openai_format import CHAT, COMPLETION, ChunkWriter, full_response_choices
from engine.params import FinishReason, GenerationRequest, RequestOutput, SamplingParams


def test_each_choice_is_its_own_request_with_its_own_seed():
    request = GenerationRequest("cmpl-1", (1, 2, 3), SamplingParams(max_tokens=4, seed=2**64 - 2))
    choices = choice_requests(request, 3)
    assert [c.request_id for c in choices] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [c.sampling.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]  # wrapped into the seed range
    assert all(c.prompt_token_ids == (1, 2, 3) for c in choices)
    unseeded = choice_requests(GenerationRequest("x", (1,), SamplingParams()), 2)
    assert [c.sampling.seed for c in unseeded] == [None, None]
    assert choice_requests(request, 1) == [request]


async def _numbers(name: str, count: int, log: list[str], fail_at: int | None = None):
    try:
        for i in range(count):
            log.append(f"{name}{i}")
            if i == fail_at:
                raise RuntimeError(f"{name} failed")
            yield f"{name}{i}"
            await asyncio.sleep(0)
    finally:
        log.append(f"{name} closed")


def test_the_other_streams_start_after_the_first_item_of_stream_0():
    log: list[str] = []

    seen_at_first: list[str] = []

    async def run():
        streams = [_numbers("a", 3, log), _numbers("b", 2, log), _numbers("c", 2, log)]
        items = []
        async for item in merge_after_first(streams):
            if not items:
                seen_at_first.extend(log)
            items.append(item)
        return items

    items = asyncio.run(run())
    assert seen_at_first == ["a0"]  # b and c were not asked for anything before a0 arrived
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"), (2, "c0"), (2, "c1")]
    assert items[0] == (0, "a0")
    assert {"a closed", "b closed", "c closed"} <= set(log)


def test_in_groups_the_first_of_each_group_starts_and_the_others_follow_it():
    log: list[str] = []

    async def run():
        names = ("a", "b", "c", "d")
        streams = [_numbers(name, 2, log) for name in names]
        merged = merge_after_first(streams, 2)  # two prompts, n=2: a and c first
        first = await anext(merged)
        started = {entry[0] for entry in log}
        return first, started, [first] + [item async for item in merged]

    first, started, items = asyncio.run(run())
    assert first[1][0] in "ac" and started <= {"a", "c"}
    assert sorted(items) == [(i, f"{name}{k}") for i, name in enumerate("abcd") for k in range(2)]
    for leader, follower in ((0, 1), (2, 3)):  # a follower's first item comes after its leader's
        assert items.index((leader, "abcd"[leader] + "0")) < items.index((follower, "abcd"[follower] + "0"))


def test_an_error_in_one_stream_closes_them_all():
    log: list[str] = []

    async def run():
        streams = [_numbers("a", 50, log), _numbers("b", 50, log, fail_at=1)]
        return [item async for item in merge_after_first(streams)]

    with pytest.raises(RuntimeError, match="b failed"):
        asyncio.run(run())
    assert {"a closed", "b closed"} <= set(log)


def _last(index: int, tokens: int) -> RequestOutput:
    return RequestOutput(
        request_id=f"r-{index}",
        token_ids=(5,),
        text=f"choice {index}",
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=10,
        num_output_tokens=tokens,
        num_cached_tokens=8,
    )


def test_the_body_lists_every_choice_and_counts_the_prompt_once():
    body = full_response_choices(COMPLETION, "cmpl-1", "m", [[_last(0, 4)], [_last(1, 6)]])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "choice 0"), (1, "choice 1")]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 10,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    chat = full_response_choices(CHAT, "chatcmpl-1", "m", [[_last(0, 4)], [_last(1, 6)]])
    assert [c["message"]["content"] for c in chat["choices"]] == ["choice 0", "choice 1"]


def test_a_batch_counts_each_prompt_once():
    lasts = [[_last(0, 4)], [_last(1, 6)], [_last(2, 1)], [_last(3, 2)]]  # two prompts, n=2
    body = full_response_choices(COMPLETION, "cmpl-1", "m", lasts, per_prompt=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {
        "prompt_tokens": 20,
        "completion_tokens": 13,
        "total_tokens": 33,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    one_each = full_response_choices(COMPLETION, "cmpl-1", "m", lasts[:3], per_prompt=1)
    assert one_each["usage"]["prompt_tokens"] == 30 and one_each["usage"]["completion_tokens"] == 11


def test_streamed_chunks_carry_their_choice_index():
    writer = ChunkWriter(CHAT, "chatcmpl-1", "m", index=1)
    assert b'"index":1' in writer.start() and b'"index":1' in writer.delta(_last(1, 6))
