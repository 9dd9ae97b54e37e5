"""``EngineCore.kv_report``: the KV invariant checked (what ``GET /admin/kv`` shows), and the
engine thread's health (what ``check_health`` raises on)."""

from __future__ import annotations

import asyncio
import threading

from engine.async_engine import AsyncEngine
from engine.params import GenerationRequest, Role
from tests.engine.conftest import greedy, tiny_loaded
from tests.waiting import wait_until_async

GATE_TIMEOUT_S = 60.0  # a held step runs anyway past this (a failed test leaves no thread behind for long)


def test_report_counts_pinned_reserved_and_running_blocks(make_engine):
    loaded, _ = tiny_loaded("llama")
    prefill = make_engine(loaded, role=Role.PREFILL, block_size=16, kv_cache_bytes=4 << 20, max_model_len=256)
    decode = make_engine(loaded, role=Role.DECODE, block_size=16, kv_cache_bytes=4 << 20, max_model_len=256)
    idle = prefill.kv_report()
    assert idle.ok and idle.num_free_blocks == idle.num_total_blocks and idle.oldest_pinned_s is None

    prefill.add_prefill(GenerationRequest("p", tuple(range(1, 41)), greedy(4)))  # 40 tokens: 3 blocks
    while prefill.has_work():
        prefill.step()
    pinned = prefill.kv_report()
    assert (pinned.num_pinned_blocks, pinned.num_pinned_requests, pinned.num_in_use_blocks) == (3, 1, 3)
    assert pinned.ok and pinned.oldest_pinned_s >= 0
    assert pinned.num_free_blocks + pinned.num_cached_blocks + pinned.num_in_use_blocks == pinned.num_total_blocks

    blocks = decode.reserve("d", 40)
    reserved = decode.kv_report()
    assert (reserved.num_reserved_blocks, reserved.num_reserved_requests) == (len(blocks), 1) and reserved.ok
    decode.release("d")
    prefill.release("p")
    after = prefill.kv_report()
    assert after.ok and after.num_in_use_blocks == 0 and after.num_pinned_blocks == 0


def test_a_block_held_by_no_request_is_reported(make_engine):
    """The leak the invariant is there to catch: a block in use that no live request holds."""
    loaded, _ = tiny_loaded("llama")
    core = make_engine(loaded, block_size=16, kv_cache_bytes=4 << 20, max_model_len=256)
    (leaked,) = core.allocator.allocate(1)
    report = core.kv_report()
    assert not report.ok
    assert report.problems == (f"1 block(s) in use by no live request, e.g. [{leaked}]",)
    core.allocator.free([leaked])
    assert core.kv_report().ok


def test_health_problem_names_a_dead_engine_thread_and_a_wedged_step():
    loaded, _ = tiny_loaded("llama")
    from engine.config import EngineConfig
    from engine.core import EngineCore

    core = EngineCore(loaded, EngineConfig(max_model_len=256, kv_cache_bytes=4 << 20))
    engine = AsyncEngine(core)
    assert engine.health_problem(stall_s=60) is None  # not started: the first call starts it
    gate, entered = _held_steps(core)

    async def main() -> tuple[str | None, str | None, str | None]:
        outputs = engine.generate(GenerationRequest("w", (1, 2, 3), greedy(2)))
        task = asyncio.ensure_future(anext(outputs))
        await wait_until_async(entered.is_set, 30, "the engine thread inside the held step")
        wedged = await wait_until_async(
            lambda: engine.health_problem(stall_s=0.1), 30, "the held step reported as wedged"
        )
        healthy = engine.health_problem(stall_s=60)
        gate.set()
        await task
        async for _ in outputs:  # to its end: nothing left pending
            pass
        await engine.stop()
        return wedged, healthy, engine.health_problem(stall_s=60)

    wedged, healthy, stopped = asyncio.run(main())
    assert wedged is not None and wedged.startswith("an engine step has run for") and "(wedged)" in wedged
    assert healthy is None
    assert stopped is None  # stopped on purpose (no thread): not a failure


def test_a_prefill_cancelled_before_admission_pins_nothing():
    """A client that goes away while its prefill's admission waits behind a long step: the
    admission still runs on the engine thread, and the abort queued behind it frees what it
    took (it used to stay pinned for good: found by bench.reliability's burst)."""
    loaded, _ = tiny_loaded("llama")
    from engine.config import EngineConfig
    from engine.core import EngineCore

    core = EngineCore(loaded, EngineConfig(role=Role.PREFILL, max_model_len=256, kv_cache_bytes=4 << 20))
    engine = AsyncEngine(core)
    gate, entered = _held_steps(core)

    async def main():
        first = asyncio.ensure_future(engine.prefill(GenerationRequest("long", tuple(range(1, 60)), greedy(4))))
        await wait_until_async(entered.is_set, 30, "the engine thread inside the first step")
        second = asyncio.ensure_future(engine.prefill(GenerationRequest("gone", tuple(range(1, 40)), greedy(4))))
        await _queued_behind_the_step(engine)
        second.cancel()
        gate.set()
        result = await first
        await engine.release("long")
        report = await engine.kv_report()
        await engine.stop()
        return result, report, second.cancelled()

    result, report, cancelled = asyncio.run(main())
    assert result.num_tokens == 59 and cancelled
    assert report.ok and report.num_pinned_requests == 0 and report.num_in_use_blocks == 0, report


def test_a_reservation_cancelled_while_queued_is_freed():
    """A decode call cancelled while its reservation waits behind a step (found by
    bench.reliability: 5 blocks reserved for good after a decode_pull cancelled in 88 ms)."""
    loaded, _ = tiny_loaded("llama")
    from engine.config import EngineConfig
    from engine.core import EngineCore

    core = EngineCore(loaded, EngineConfig(role=Role.BOTH, max_model_len=256, kv_cache_bytes=4 << 20))
    engine = AsyncEngine(core)
    gate, entered = _held_steps(core)

    async def main():
        busy = engine.generate(GenerationRequest("busy", tuple(range(1, 30)), greedy(2)))
        first = asyncio.ensure_future(anext(busy))
        await wait_until_async(entered.is_set, 30, "the engine thread inside the first step")
        reserve = asyncio.ensure_future(engine.reserve_prefix("gone", tuple(range(1, 50))))
        await _queued_behind_the_step(engine)
        reserve.cancel()
        gate.set()
        await first
        async for _ in busy:
            pass
        report = await engine.kv_report()
        await engine.stop()
        return report

    report = asyncio.run(main())
    assert report.ok and report.num_reserved_requests == 0 and report.num_in_use_blocks == 0, report


def _held_steps(core) -> tuple[threading.Event, threading.Event]:
    """Make ``core``'s steps wait for the returned ``gate`` (commands queue meanwhile); the
    second event is set once the engine thread is inside a held step."""
    gate, entered = threading.Event(), threading.Event()
    step = core.step

    def held_step():
        entered.set()
        gate.wait(GATE_TIMEOUT_S)
        return step()

    core.step = held_step
    return gate, entered


async def _queued_behind_the_step(engine: AsyncEngine) -> None:
    """The command just issued sits in the engine's queue (applied only after the held step)."""
    await wait_until_async(lambda: len(engine._commands), 30, "a command queued behind the held step")
