"""AsyncEngine: background step loop, streaming, cancellation frees blocks, P/D API."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.core import RoleError
from engine.params import FinishReason, Role, SamplingParams


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
        while len(seen) < 3:
            await asyncio.sleep(0.01)
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


def test_a_request_waiting_for_blocks_sleeps_until_a_release(smol, make_engine):
    """Blocks all pinned: the engine thread must wait for a command, not spin on empty steps."""
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
        done = await engine.prefill(first)
        waiting = asyncio.create_task(engine.prefill(second))
        await asyncio.sleep(0.5)
        stuck = (await engine.stats(), steps)
        assert await engine.release(first.request_id)
        second_done = await waiting
        assert await engine.release(second.request_id)
        idle = await engine.stats()
        await engine.stop()
        return done, stuck, second_done, idle

    done, (stuck, stuck_steps), second_done, idle = asyncio.run(main())
    assert len(done.block_ids) == 3 and len(second_done.block_ids) == 3
    assert (stuck.num_waiting, stuck.num_pinned_blocks, stuck.num_free_blocks) == (1, 3, 1)
    # a 50 ms recheck gives about 10 steps in 0.5 s; a spinning thread makes thousands
    assert stuck_steps < 40
    assert idle.num_free_blocks == idle.num_total_blocks == 4
