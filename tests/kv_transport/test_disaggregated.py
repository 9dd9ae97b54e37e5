"""Prefill and decode in two Ray actors (two processes), KV over real NIXL.

The session's Ray; a prefill actor and a decode actor (role ``both``, which also computes the
single-engine reference), both of a tiny random-weight Llama with near one-hot attention
(``SHARP`` in tests/tiny_models.py): a KV block lost, misplaced or stale changes its tokens.
The default model's KV crosses the same transports in tests/deployments/test_serve_app.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
import ray
import torch

from engine.loader import ModelSpec
from engine.params import GenerationRequest, SamplingParams
from kv_transport.base import KVTransferError, StalePeerError
from kv_transport.nixl_transport import LATE_WRITE_MARGIN_S
from tests.same_output import assert_same_output, trace_from_outputs
from tests.tiny_models import SHARP, random_ids, tiny_config
from tests.waiting import wait_until

TIMEOUT_S = 30.0
SHORT_TIMEOUT_S = 3.0
LENGTHS = (3, 17, 60, 150, 300, 420, 510, 700)
IDLE_TIMEOUT_S = 10.0  # release notices, aborts and cancellations free blocks asynchronously
START_TIMEOUT_S = 30.0  # a request reaching the decode engine
LAYERS = 3
BLOCK_BYTES = 16 * 2 * 16 * 4  # one layer's K (or V) of one block: 16 tokens x 2 heads x 16 x float32
ENGINE = {"max_model_len": 1024, "kv_cache_bytes": 4 << 20}  # the tiny model's context; 341 blocks
HOLD_S = 1.5  # how long a request must stay held on a full decode pool (its lease is TIMEOUT_S)
# a fetch held before its READ until its producer is seen dead (the delay is cut then; this bounds it)
FETCH_HELD_S = TIMEOUT_S


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> ModelSpec:
    folder = tmp_path_factory.mktemp("tiny-sharp")
    tiny_config("llama", SHARP).save_pretrained(folder)
    return ModelSpec(source=str(folder), dummy_weights=True)


def _engine_actor(spec: ModelSpec, engine_id: str, role: str, timeout_s: float):
    from bench.engine_actor import EngineActor

    return EngineActor.remote(engine_id, role, timeout_s=timeout_s, spec=spec, **ENGINE)


@pytest.fixture(scope="module")
def actors(shared_ray, spec):
    prefill = _engine_actor(spec, "prefill-0", "prefill", TIMEOUT_S)
    decode = _engine_actor(spec, "decode-0", "both", TIMEOUT_S)
    ray.get([prefill.start.remote(), decode.start.remote()])
    yield prefill, decode
    ray.get([prefill.close.remote(), decode.close.remote()])


@pytest.fixture(scope="module")
def prompts():
    return [random_ids(n, seed=i) for i, n in enumerate(LENGTHS)]


def _request(prefix: str, i: int, prompt: list[int], max_tokens: int = 32) -> GenerationRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    return GenerationRequest(f"{prefix}-{i}", tuple(prompt), sp)


def _stats(actor):
    return ray.get(actor.stats.remote())


def _wait_for(actor, what: str, until) -> None:
    wait_until(lambda: _stats(actor), START_TIMEOUT_S, what, until=until)


def _gone(actor) -> bool:
    """The actor refuses calls: dead."""
    try:
        ray.get(actor.stats.remote(), timeout=TIMEOUT_S)
    except ray.exceptions.RayActorError:
        return True
    return False


def _exited(pid: int) -> bool:
    """The process is gone, or a zombie: its memory freed, so nothing can READ from it any more
    (an actor refuses calls before its process has ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _is_idle(stats) -> bool:
    blocks_held = (stats.num_pinned_blocks, stats.num_reserved_blocks, stats.num_running)
    return stats.num_free_blocks == stats.num_total_blocks and blocks_held == (0, 0, 0)


def _assert_idle(*actors):
    """Idle right now: for frees that happen before the call that caused them returns."""
    for stats in ray.get([a.stats.remote() for a in actors]):
        assert _is_idle(stats), stats


def _wait_idle(*actors, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Idle within ``timeout_s``: for frees that arrive later (release notices, aborts, lease ends)."""
    read = lambda: ray.get([a.stats.remote() for a in actors])  # noqa: E731
    wait_until(
        read, timeout_s, "all blocks free and nothing running", until=lambda all_stats: all(map(_is_idle, all_stats))
    )


@contextmanager
def _transport_timeout(timeout_s: float, *actors) -> Iterator[None]:
    """Set the KV transfer timeout of module-shared actors; put ``TIMEOUT_S`` back even if the test fails."""
    ray.get([a.set_timeout.remote(timeout_s) for a in actors])
    try:
        yield
    finally:
        ray.get([a.set_timeout.remote(TIMEOUT_S) for a in actors])


@contextmanager
def _faults(actor, **faults) -> Iterator[None]:
    """Fault points on a module-shared actor, cleared even if the test fails."""
    ray.get(actor.set_faults.remote(**faults))
    try:
        yield
    finally:
        ray.get(actor.set_faults.remote())


@pytest.fixture
def spawn(shared_ray, spec):
    """Start extra engine actors for one test; all killed at its end, passed or failed."""
    spawned = []

    def start(engine_id: str, role: str, timeout_s: float):
        spawned.append(_engine_actor(spec, engine_id, role, timeout_s))
        return spawned[-1]

    yield start
    for actor in spawned:
        ray.kill(actor)


@pytest.fixture(scope="module")
def reference(actors, prompts):
    _, decode = actors
    runs = ray.get([decode.generate.remote(_request("both", i, p)) for i, p in enumerate(prompts)])
    return [trace_from_outputs(r) for r in runs]


def test_pull_matches_single_engine(actors, prompts, reference):
    prefill, decode = actors
    requests = [_request("pull", i, p) for i, p in enumerate(prompts)]
    prefilled = ray.get([prefill.prefill_pull.remote(r) for r in requests])
    for (result, handle), prompt in zip(prefilled, prompts):
        assert handle.num_tokens == len(prompt) and handle.first_token == result.first_token
    runs = ray.get([decode.decode_pull.remote(r, h, res.first_logprobs) for r, (res, h) in zip(requests, prefilled)])
    for i, ((result, _), outputs) in enumerate(zip(prefilled, runs)):
        # the first token and its log-probabilities come from prefill
        assert outputs[0].token_ids == (result.first_token,) and outputs[0].logprobs == (result.first_logprobs,)
        assert_same_output(reference[i], trace_from_outputs(outputs), exact=False, label=f"pull {i}")
    _wait_idle(prefill, decode)  # release notices are asynchronous


def test_push_matches_single_engine(actors, prompts, reference):
    prefill, decode = actors
    requests = [_request("push", i, p) for i, p in enumerate(prompts)]
    destinations = ray.get([decode.reserve_push.remote(r) for r in requests])
    decoding = [decode.decode_push.remote(r, d) for r, d in zip(requests, destinations)]
    pushed = ray.get([prefill.prefill_push.remote(r, d) for r, d in zip(requests, destinations)])
    runs = ray.get(decoding)
    # the reference ran these prompts on the decode actor: its prefix cache holds their full
    # blocks, which the destinations list as held; only the rest is written
    assert sum(d.skip_blocks for d in destinations) > 0
    for i, ((result, stats), outputs) in enumerate(zip(pushed, runs)):
        written = len(destinations[i].block_ids) - destinations[i].skip_blocks
        assert stats.num_bytes == LAYERS * 2 * written * BLOCK_BYTES
        assert [t.layer for t in stats.layer_times] == list(range(LAYERS))
        # the first token's log-probabilities came inside the completion notice (JSON: exact)
        assert outputs[0].logprobs == (result.first_logprobs,) and result.first_logprobs is not None
        assert_same_output(reference[i], trace_from_outputs(outputs), exact=False, label=f"push {i}")
    _assert_idle(prefill, decode)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_shared_prefix_moves_once(actors, mode):
    """Two requests sharing a 320-token prefix never seen before: the second one's transfer
    moves only the blocks past the prefix (the decode replica's cache holds the rest), and
    its prefill skips the prefix (``num_cached_tokens``); outputs match the single engine."""
    prefill, decode = actors
    prefix = random_ids(320, seed=100 if mode == "pull" else 200)
    tails = [random_ids(40, seed=300 + i) for i in range(2)]
    moved = []
    for i, tail in enumerate(tails):
        request = _request(f"prefix-{mode}", i, prefix + tail)
        if mode == "pull":
            result, handle = ray.get(prefill.prefill_pull.remote(request))
            outputs = ray.get(decode.decode_pull.remote(request, handle, result.first_logprobs))
            moved.append(ray.get(decode.last_fetch_bytes.remote()))
        else:
            destination = ray.get(decode.reserve_push.remote(request))
            decoding = decode.decode_push.remote(request, destination)
            result, stats = ray.get(prefill.prefill_push.remote(request, destination))
            outputs = ray.get(decoding)
            moved.append(stats.num_bytes)
        assert result.num_cached_tokens == (0 if i == 0 else 320)
        want = trace_from_outputs(ray.get(decode.generate.remote(_request(f"prefix-{mode}-ref", i, prefix + tail))))
        assert_same_output(want, trace_from_outputs(outputs), exact=False, label=f"{mode} {i}")
    blocks = [-(-360 // 16), -(-360 // 16) - 320 // 16]  # all 23 blocks, then the 3 past the prefix
    assert moved == [LAYERS * 2 * n * BLOCK_BYTES for n in blocks]
    _wait_idle(prefill, decode)


def test_abort_on_either_side_frees_blocks(actors, prompts):
    prefill, decode = actors
    for attempt in range(3):  # 850 tokens take a few seconds: a machine stalled that long ends one first
        request = _request("abort-d", attempt, prompts[3], max_tokens=850)
        _, handle = ray.get(prefill.prefill_pull.remote(request))
        running = decode.decode_pull.remote(request, handle)
        wait_until(
            lambda running=running: (bool(ray.wait([running], timeout=0)[0]), _stats(decode).num_running),
            START_TIMEOUT_S,
            "decode running the request (or done with it)",
            until=lambda state: state[0] or state[1] == 1,
        )
        ray.cancel(running)
        try:
            ray.get(running)
        except (ray.exceptions.TaskCancelledError, asyncio.CancelledError):
            break
        _wait_idle(prefill, decode)  # it ended before the cancel: every block back, then once more
    else:
        pytest.fail("no cancel reached the decode while it ran, in 3 tries")
    _wait_idle(prefill, decode)  # the export: released by the decode side's notice, asynchronously
    request = _request("abort-p", 0, prompts[4])
    _, handle = ray.get(prefill.prefill_pull.remote(request))
    assert ray.get(prefill.stats.remote()).num_pinned_blocks == len(handle.block_ids)
    ray.get(prefill.abort.remote(request.request_id))
    _wait_idle(prefill, decode)


@contextmanager
def _filled_decode_pool(decode, prefix: str) -> Iterator[list[str]]:
    """Reserve decode blocks until fewer than 8 (128 tokens) are free; all released on exit
    (releasing one the test released already is a no-op), so a failure leaves the pool empty."""
    fillers = []
    try:
        while (free := ray.get(decode.stats.remote()).num_free_blocks) >= 8:
            fillers.append(f"{prefix}-{len(fillers)}")
            assert ray.get(decode.reserve.remote(fillers[-1], min(ENGINE["max_model_len"], (free - 4) * 16)))
        yield fillers
    finally:
        _release(decode, fillers)


def _release(decode, request_ids: list[str]) -> None:
    ray.get([decode.release.remote(rid) for rid in request_ids])


def test_pull_waits_for_decode_blocks_within_the_lease(actors, prompts, reference):
    """A full decode pool holds the request (producer KV pinned) until blocks free up; a pool
    that stays full past the lease fails it with KVCapacityError, and nothing leaks."""
    prefill, decode = actors
    with _filled_decode_pool(decode, "filler") as fillers:
        request = _request("wait", 5, prompts[5])
        result, handle = ray.get(prefill.prefill_pull.remote(request))
        running = decode.decode_pull.remote(request, handle, result.first_logprobs)
        # the scenario, not a synchronization: the request must still be held (not failed) HOLD_S later
        done, _ = ray.wait([running], timeout=HOLD_S)
        assert not done and _stats(prefill).num_pinned_blocks == len(handle.block_ids)  # still waiting
        _release(decode, fillers)
        outputs = ray.get(running)
    assert_same_output(reference[5], trace_from_outputs(outputs), exact=False, label="waited")
    _wait_idle(prefill, decode)
    # a pool that stays full: the wait ends with the lease (SHORT_TIMEOUT_S - 1 s margin)
    with _transport_timeout(SHORT_TIMEOUT_S, prefill, decode):
        with _filled_decode_pool(decode, "stuck"):
            request = _request("nowait", 5, prompts[5])
            _, handle = ray.get(prefill.prefill_pull.remote(request))
            with pytest.raises(ray.exceptions.RayTaskError, match=f"KVCapacityError.*no room for {LENGTHS[5]} tokens"):
                ray.get(decode.decode_pull.remote(request, handle))
        # the producer's unclaimed KV is freed at its timeout
        _wait_idle(prefill, decode, timeout_s=SHORT_TIMEOUT_S + IDLE_TIMEOUT_S)


def test_unclaimed_kv_is_freed_after_the_timeout(actors, prompts):
    prefill, decode = actors
    expired = ray.get(prefill.num_expired_exports.remote())
    with _transport_timeout(SHORT_TIMEOUT_S, prefill, decode):
        ray.get(prefill.prefill_pull.remote(_request("unclaimed", 0, prompts[2])))
        _wait_idle(prefill, decode, timeout_s=SHORT_TIMEOUT_S + IDLE_TIMEOUT_S)
        assert ray.get(prefill.num_expired_exports.remote()) == expired + 1  # pinned until its lease's end
        # a push that never comes: decode gives up after the timeout and frees its reservation, once
        # no WRITE can land in it (the producer heard nothing, and posts none after the expiry)
        request = _request("nopush", 0, prompts[2])
        destination = ray.get(decode.reserve_push.remote(request))
        with pytest.raises(ray.exceptions.RayTaskError, match="KVTransferTimeout.*no push completion"):
            ray.get(decode.decode_push.remote(request, destination))
        _wait_idle(prefill, decode)
        assert time.time() >= destination.expires_at + LATE_WRITE_MARGIN_S


def test_killed_producer_fails_the_transfer_and_a_restart_is_rehandshaken(actors, prompts, reference, spawn):
    _, decode = actors
    victim = spawn("victim", "prefill", timeout_s=TIMEOUT_S)  # its lease outlasts the held fetch
    first_incarnation = ray.get(victim.start.remote())
    handshakes = ray.get(decode.num_handshakes.remote())
    request = _request("killed", 0, prompts[5])
    _, handle = ray.get(victim.prefill_pull.remote(request))
    pid = ray.get(victim.pid.remote())
    with _transport_timeout(SHORT_TIMEOUT_S, decode):
        with _faults(decode, delay_s={"fetch": FETCH_HELD_S}):
            fetching = decode.decode_pull.remote(request, handle)
            # blocks reserved: the fetch has begun and is held in its fault delay, before the READ
            _wait_for(
                decode,
                "decode reserving blocks for the fetch",
                lambda s: s.num_reserved_blocks == len(handle.block_ids),
            )
            ray.kill(victim)  # asynchronous: a call made just after it may still be answered
            wait_until(lambda: _gone(victim), TIMEOUT_S, "the killed producer to refuse calls")
            wait_until(lambda: _exited(pid), TIMEOUT_S, "the killed producer's process to end")
            assert not ray.wait([fetching], timeout=0)[0], "the fetch ended before its producer died"
        # the faults cleared: the held fetch goes on to its READ, from a dead producer
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(fetching, timeout=TIMEOUT_S)  # ends: a fetch from a dead peer does not hang
        assert isinstance(info.value.cause, KVTransferError), info.value
        assert "request killed-0" in str(info.value.cause) and "victim" in str(info.value.cause)
    _assert_idle(decode)

    restarted = spawn("victim", "prefill", timeout_s=TIMEOUT_S)
    assert ray.get(restarted.start.remote()) != first_incarnation
    tries = []

    def refused_as_stale() -> bool:
        """A call with the dead incarnation's handle fails; as stale once the decode side has
        re-checked that peer in the registry (at most every PEER_CHECK_INTERVAL_S: until then
        it may still READ from the dead peer, a transfer error)."""
        tries.append(_request(f"stale-{len(tries)}", 0, prompts[5]))
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(decode.decode_pull.remote(tries[-1], handle))
        assert isinstance(info.value.cause, KVTransferError), info.value
        return isinstance(info.value.cause, StalePeerError)

    with _transport_timeout(SHORT_TIMEOUT_S, decode):
        wait_until(refused_as_stale, TIMEOUT_S, "the dead incarnation's handle refused as stale")
    request = _request("again", 5, prompts[5])
    result, handle = ray.get(restarted.prefill_pull.remote(request))
    outputs = ray.get(decode.decode_pull.remote(request, handle, result.first_logprobs))
    assert_same_output(reference[5], trace_from_outputs(outputs), exact=False, label="restarted")
    assert ray.get(decode.num_handshakes.remote()) == handshakes + 2
    _wait_idle(decode, restarted)
    ray.get(restarted.close.remote())


def test_object_store_baseline_moves_the_same_bytes(shared_ray):
    from engine.kv_pool import KVLayout
    from kv_transport.object_store import ObjectStoreTransport

    layout = KVLayout(dtype="float32", num_layers=2, block_size=4, num_kv_heads=1, head_dim=8)
    src = torch.rand(2, 2, 6, 4, 1, 8)
    dst = torch.zeros(2, 2, 5, 4, 1, 8)
    released = []
    producer, consumer = ObjectStoreTransport("os-p", layout), ObjectStoreTransport("os-c", layout)
    producer.register_pool(src, released.append)
    consumer.register_pool(dst, lambda rid: None)
    handle = producer.export("os-1", [1, 4], num_tokens=7, first_token=3)
    assert released == ["os-1"]  # the object-store copy holds the KV: blocks freed at export
    stats = asyncio.run(consumer.fetch(handle, [0, 3]))
    assert torch.equal(dst[:, :, [0, 3]], src[:, :, [1, 4]]) and torch.all(dst[:, :, [1, 2, 4]] == 0)
    assert stats.num_bytes == 2 * 2 * 2 * 4 * 8 * 4
    assert not producer.supports_push
    with pytest.raises(KVTransferError, match="pull only"):
        producer.destination("x", [0], 1)
