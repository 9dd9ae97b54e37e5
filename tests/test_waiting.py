"""tests.waiting: returns the first value that satisfies the condition; fails naming what and the last value."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from tests.waiting import MAX_POLL_S, _pauses, ok_json, wait_until, wait_until_async


def test_returns_the_first_value_that_holds():
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 30, "the third read", until=lambda n: n >= 2, poll_s=0.001) == 2


def test_times_out_naming_what_and_the_last_value():
    with pytest.raises(AssertionError, match=r"after 0\.05 s waiting for blocks free; last value: \{'free': 3\}"):
        wait_until(lambda: {"free": 3}, 0.05, "blocks free", until=lambda s: s["free"] == 4)


def test_reads_once_with_no_time_left():
    assert wait_until(lambda: "ready", 0, "ready") == "ready"


def test_async_twin_awaits_async_reads_and_yields_to_the_loop():
    seen = []

    async def producer():
        for i in range(3):
            await asyncio.sleep(0.001)
            seen.append(i)

    async def latest():
        return len(seen)

    async def main():
        task = asyncio.create_task(producer())  # runs only while the wait yields to the loop
        count = await wait_until_async(latest, 30, "three items", until=lambda n: n == 3, poll_s=0.001)
        await task
        with pytest.raises(AssertionError, match="waiting for nothing; last value: 3"):
            await wait_until_async(lambda: len(seen), 0.01, "nothing", until=lambda n: n > 3)
        return count

    assert asyncio.run(main()) == 3


def test_the_pause_between_reads_grows_to_a_cap():
    pauses = list(itertools.islice(_pauses(0.02), 12))
    assert pauses[0] == 0.02 and pauses == sorted(pauses) and pauses[-1] == MAX_POLL_S
    assert set(itertools.islice(_pauses(2.0), 3)) == {2.0}  # a longer first pause is kept


def test_ok_json_reads_a_200_and_leaves_any_other_answer_as_not_yet():
    assert ok_json(httpx.Response(200, json={"replicas": []})) == {"replicas": []}
    busy = {"error": {"message": "the autoscaler's controller did not answer"}}
    assert ok_json(httpx.Response(503, json=busy)) is None
