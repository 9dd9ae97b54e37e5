"""AsyncEngine: background step loop, streaming, cancellation frees blocks, P/D API."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.params import FinishReason, Role, RoleError, SamplingParams
from tests.waiting import wait_until_async


def _collect(engine, request):
    async def run():
        return [o async for o in engine.generate(request)]

    return run()


def test_generate_streams_and_matches_the_sync_engine(smol, make_engine):
    core = make_engine(smol)
    request = core.make_request(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=20, temperature=0)
    )

    async def main():
        engine = AsyncEngine(core)
        outs = await _collect(engine, request)
        other = [core.make_request(f"Count to {n}:", SamplingParams(max_tokens=6, temperature=0)) for n in (3, 5, 7)]
        many = await asyncio.gather(*(_collect(engine, r) for r in other))
        stats = await engine.stats()
        await engine.stop()
        return outs, many, stats

    outs, many, stats = asyncio.run(main())
    assert "".join(o.text for o in outs) == "The capital of France is Paris."
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
    assert [m[-1].num_output_tokens for m in many] == [6, 6, 6]
    assert stats.num_free_blocks == stats.num_total_blocks


def test_consumer_leaving_aborts_and_frees_blocks(smol, make_engine):
    core = make_engine(smol)
    request = core.make_request("Write a long essay about rivers.", SamplingParams(max_tokens=500, ignore_eos=True))

    async def main():
        engine = AsyncEngine(core)
        seen = []

        async def consume():
            async for out in engine.generate(request):
                seen.append(out)

        task = asyncio.create_task(consume())
        await wait_until_async(lambda: len(seen), 30, "three streamed outputs", until=lambda n: n >= 3)
        busy = await engine.stats()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        idle = await engine.stats()
        await engine.stop()
        return busy, idle, seen

    busy, idle, seen = asyncio.run(main())
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_total_blocks
    assert (idle.num_running, idle.num_free_blocks) == (0, idle.num_total_blocks)
    assert 3 <= len(seen) < 500


def test_prefill_reserve_decode_release(smol, make_engine):
    p_core = make_engine(smol, role=Role.PREFILL)
    d_core = make_engine(smol, role=Role.DECODE)
    request = p_core.make_request(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=20, temperature=0)
    )

    async def main():
        prefill, decode = AsyncEngine(p_core), AsyncEngine(d_core)
        with pytest.raises(RoleError):
            await decode.prefill(request)
        result = await prefill.prefill(request)
        pinned = (await prefill.stats()).num_pinned_blocks
        blocks = await decode.reserve(request.request_id, result.num_tokens)
        d_core.pool.copy_blocks_from(p_core.pool, list(result.block_ids), blocks)
        assert await prefill.release(request.request_id)
        outs = [o async for o in decode.decode(request, blocks, result.first_token)]
        await prefill.stop()
        await decode.stop()
        return result, pinned, outs

    result, pinned, outs = asyncio.run(main())
    assert pinned == len(result.block_ids) == 3
    assert outs[0].token_ids == (result.first_token,)
    assert "".join(o.text for o in outs) == "The capital of France is Paris."


class CountingWakeup(threading.Event):
    """The engine thread's wake-up event, counting the waits with a timeout (the recheck of a
    round in which nothing could run)."""

    def __init__(self) -> None:
        super().__init__()
        self.timed_waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
        return super().wait(timeout)


def test_a_request_waiting_for_blocks_sleeps_until_a_release(smol, make_engine):
    """Blocks all pinned: the engine thread must wait for a command, not spin on empty steps:
    every round in which nothing could run ends in a timed wait on the wake-up event."""
    core = make_engine(smol, role=Role.PREFILL, max_model_len=64, num_blocks=4)
    assert core.stats().num_total_blocks == 4
    first = core.make_request("word " * 39, SamplingParams(max_tokens=2))  # 40 tokens: 3 blocks
    second = core.make_request("line " * 39, SamplingParams(max_tokens=2))
    steps = 0
    real_step = core.step

    def counting_step():
        nonlocal steps
        steps += 1
        return real_step()

    core.step = counting_step

    async def main():
        engine = AsyncEngine(core)
        engine._wakeup = wakeup = CountingWakeup()  # before the thread starts (at the first call)
        done = await engine.prefill(first)
        steps_before, waits_before = steps, wakeup.timed_waits
        waiting = asyncio.create_task(engine.prefill(second))
        await wait_until_async(lambda: wakeup.timed_waits, 30, "3 timed waits", until=lambda n: n >= waits_before + 3)
        stuck = (await engine.stats(), steps - steps_before, wakeup.timed_waits - waits_before)
        assert await engine.release(first.request_id)
        second_done = await waiting
        assert await engine.release(second.request_id)
        idle = await engine.stats()
        await engine.stop()
        return done, stuck, second_done, idle

    done, (stuck, stuck_steps, stuck_waits), second_done, idle = asyncio.run(main())
    assert len(done.block_ids) == 3 and len(second_done.block_ids) == 3
    assert (stuck.num_waiting, stuck.num_pinned_blocks, stuck.num_free_blocks) == (1, 3, 1)
    # one step per round, and each round that could not run slept; the rounds that answered a
    # command (the admission, the stats call) and the one in progress need no wait
    assert stuck_steps <= stuck_waits + 3, (stuck_steps, stuck_waits)
    assert idle.num_free_blocks == idle.num_total_blocks == 4


def test_stats_snapshot_and_layer_hooks_come_from_the_engine_thread(smol, make_engine):
    core = make_engine(smol)
    request = core.make_request("Count to 5:", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    seen: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []

    async def main():
        engine = AsyncEngine(core)
        engine.add_layer_hook(lambda layer, chunks: seen.append((layer, *_chunk_facts(chunks))))
        before = engine.latest_stats()
        outs = await _collect(engine, request)
        after = engine.latest_stats()
        with pytest.raises(RuntimeError, match="before the engine serves requests"):
            engine.add_layer_hook(lambda layer, chunks: None)
        await engine.stop()
        return before, outs, after

    before, outs, after = asyncio.run(main())
    num_layers = core.layout.num_layers
    assert before.num_free_blocks == before.num_total_blocks and after == core.stats()
    assert [o.num_output_tokens for o in outs] == [1, 2, 3]
    # one forward for the prompt and one per further token, each calling every layer in order
    num_prompt = len(request.prompt_token_ids)
    assert [layer for layer, _, _ in seen] == list(range(num_layers)) * 3
    assert {(ids, sizes) for _, ids, sizes in seen[:num_layers]} == {((request.request_id,), (num_prompt,))}
    assert {(ids, sizes) for _, ids, sizes in seen[num_layers:]} == {((request.request_id,), (1,))}


def _chunk_facts(chunks) -> tuple[tuple[str, ...], tuple[int, ...]]:
    return tuple(c.request_id for c in chunks), tuple(len(c.token_ids) for c in chunks)
