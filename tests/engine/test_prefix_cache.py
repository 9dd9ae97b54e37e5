"""Automatic prefix caching: the allocator's hash-chained cache, and the engine skipping the
prefill of a prompt's cached leading blocks with the same output as without the cache.

The engine tests compare an engine with the cache against one without, on the same model: a
tiny random-weight Llama with near one-hot attention (``SHARP`` in tests/tiny_models.py), as
the claim is the cache's, not the model's (tests/engine/test_same_output.py holds the default
model to transformers' tokens). A cached prefix with one block swapped for another changes
its tokens in three of these tests; on the default model it did in one."""

from __future__ import annotations

import pytest

from engine.block_allocator import BlockAllocator, BlockAllocatorError, hash_blocks
from engine.loader import LoadedModel
from engine.params import GenerationRequest, PrefillResult, Role
from tests.engine.conftest import greedy, run_to_completion, tiny_loaded
from tests.same_output import assert_same_output, trace_from_outputs
from tests.tiny_models import SHARP, random_ids

# ---- the allocator -------------------------------------------------------------------------


def test_a_blocks_key_covers_every_token_before_it():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = hash_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix: different key
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4) == a  # deterministic


def test_freed_cached_blocks_are_evictable_free_blocks_reused_by_key():
    alloc = BlockAllocator(num_blocks=4, block_size=2, enable_caching=True)
    keys = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    blocks = alloc.allocate(3)
    for block, key in zip(blocks, keys):
        assert alloc.register(block, key)
    alloc.free(blocks)
    alloc.check()
    assert (alloc.num_free_blocks, alloc.num_cached_blocks, alloc.num_uncached_free_blocks) == (4, 3, 1)
    # a prompt sharing the first two blocks finds them, takes them back from the evictable set
    hit = alloc.match_prefix(hash_blocks([1, 2, 3, 4, 9, 9], 2))
    assert hit == blocks[:2]
    alloc.share(hit)
    assert [alloc.ref_count(b) for b in hit] == [1, 1] and alloc.num_cached_blocks == 1
    alloc.check()
    # room is made by evicting the least recently freed cached block once the free list is empty
    assert alloc.allocate(2) == [3, blocks[2]]
    assert alloc.num_evictions == 1 and alloc.match_prefix(keys) == blocks[:2]  # key 3 gone
    alloc.free(hit)
    alloc.free([3, blocks[2]])
    alloc.check()
    assert alloc.num_uncached_free_blocks + alloc.num_cached_blocks == alloc.num_blocks


def test_a_key_is_held_by_one_block_and_caching_off_caches_nothing():
    alloc = BlockAllocator(num_blocks=3, block_size=2, enable_caching=True)
    (key,) = hash_blocks([7, 7], 2)
    first, second = alloc.allocate(2)
    assert alloc.register(first, key) and not alloc.register(second, key)
    alloc.free([first, second])
    assert alloc.num_cached_blocks == 1
    with pytest.raises(BlockAllocatorError, match="holds no cached prefix"):
        alloc.share([second])
    off = BlockAllocator(num_blocks=3, block_size=2)
    (block,) = off.allocate(1)
    assert not off.register(block, key) and off.match_prefix([key]) == []
    off.free([block])
    assert off.num_cached_blocks == 0


# ---- the engine ----------------------------------------------------------------------------

PREFIX = 600
CONTEXT = 1024  # the tiny model's context


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_loaded("llama", initializer_range=SHARP)[0]


@pytest.fixture(scope="module")
def shared_prefix_prompts() -> list[list[int]]:
    prefix = random_ids(PREFIX, seed=0)
    return [prefix + random_ids(40, seed=1 + i) for i in range(3)]


def _drain(core) -> list:
    outputs = []
    while core.has_work():
        outputs += core.step()
    return outputs


def _run_one(core, request_id: str, prompt: list[int], max_tokens: int = 32):
    request = GenerationRequest(request_id, tuple(prompt), greedy(max_tokens))
    return run_to_completion(core, {0: [request]})[request_id]


def test_a_shared_prefix_is_prefilled_once_with_the_same_output(tiny, make_engine, shared_prefix_prompts):
    cached = make_engine(tiny, block_size=16, max_model_len=CONTEXT)
    plain = make_engine(tiny, block_size=16, max_model_len=CONTEXT, enable_prefix_caching=False)
    first = _run_one(cached, "a", shared_prefix_prompts[0])
    assert first[-1].num_cached_tokens == 0
    steps_before = cached.stats().prefix_hit_tokens
    second = _run_one(cached, "b", shared_prefix_prompts[1])
    full_blocks = PREFIX // 16 * 16  # the prefix's full blocks: 592 tokens
    assert second[-1].num_cached_tokens == full_blocks
    stats = cached.stats()
    assert stats.prefix_hit_tokens - steps_before == full_blocks
    assert stats.prefix_query_tokens == 2 * len(shared_prefix_prompts[0])
    reference = _run_one(plain, "b", shared_prefix_prompts[1])
    assert reference[-1].num_cached_tokens == 0 and plain.stats().prefix_hit_tokens == 0
    assert_same_output(trace_from_outputs(reference), trace_from_outputs(second), exact=False, label="cached")
    # the cache keeps both prompts' full blocks; all of them free (evictable) again
    assert stats.num_cached_blocks >= PREFIX // 16
    cached.allocator.check()


def test_eviction_under_a_tiny_pool_stays_correct(tiny, make_engine):
    """A pool of 20 blocks holds one 232-token request (15 blocks) at a time: each new prompt
    evicts cached blocks of the last; outputs stay those of the uncached engine, and the
    first prompt, asked again, finds only what was not evicted."""
    small = make_engine(tiny, block_size=16, num_blocks=20, max_num_seqs=1, max_model_len=256)
    plain = make_engine(tiny, block_size=16, enable_prefix_caching=False, max_model_len=256)
    prompts = [random_ids(200, seed=10 + i) for i in range(3)]
    for i, prompt in enumerate([*prompts, prompts[0]]):
        got = _run_one(small, f"t{i}", prompt)
        want = _run_one(plain, f"t{i}", prompt)
        assert_same_output(trace_from_outputs(want), trace_from_outputs(got), exact=False, label=f"small pool {i}")
        small.allocator.check()
    assert small.stats().num_evictions > 0
    assert got[-1].num_cached_tokens < 192  # some of the first prompt's 12 full blocks were evicted


def test_a_prefill_replica_caches_and_a_decode_replica_holds_what_it_fetched(tiny, make_engine, shared_prefix_prompts):
    """Disaggregated in one process: the second request's prefill skips the prefix, and the
    decode replica reserves with its own cache: only the new blocks need copying."""
    prefill = make_engine(tiny, block_size=16, max_model_len=CONTEXT, role=Role.PREFILL)
    decode = make_engine(tiny, block_size=16, max_model_len=CONTEXT, role=Role.DECODE)
    plain = make_engine(tiny, block_size=16, max_model_len=CONTEXT, enable_prefix_caching=False)
    for i, prompt in enumerate(shared_prefix_prompts[:2]):
        request = GenerationRequest(f"pd-{i}", tuple(prompt), greedy())
        prefill.add_prefill(request)
        (final,) = _drain(prefill)
        result = PrefillResult.from_output(final)
        assert result.num_cached_tokens == (0 if i == 0 else PREFIX // 16 * 16)
        blocks, held = decode.reserve_prefix(request.request_id, prompt)
        assert held == (0 if i == 0 else PREFIX // 16)
        decode.pool.copy_blocks_from(prefill.pool, list(result.block_ids[held:]), blocks[held:])
        assert prefill.release(request.request_id)
        decode.add_decode(request, blocks, result.first_token, result.first_logprobs)
        outputs = _drain(decode)
        want = _run_one(plain, f"pd-{i}", prompt)
        assert_same_output(trace_from_outputs(want), trace_from_outputs(outputs), exact=False, label=f"pd {i}")
    decode.allocator.check()
    prefill.allocator.check()


def test_chunked_prefill_and_preemption_keep_working_with_shared_blocks(tiny, make_engine):
    """Three requests sharing a 96-token prefix in a pool too small for all of them, with
    64-token chunks: the later ones share the first one's blocks, newer ones are preempted
    and recomputed (from the cache), and every output is the uncached engine's."""
    tight = make_engine(
        tiny, block_size=16, num_blocks=24, max_model_len=256, enable_chunked_prefill=True, max_num_batched_tokens=64
    )
    plain = make_engine(tiny, block_size=16, enable_prefix_caching=False, max_model_len=256)
    prefix = random_ids(96, seed=20)
    prompts = [prefix + random_ids(40, seed=21 + i) for i in range(3)]
    requests = [GenerationRequest(f"c{i}", tuple(p), greedy(64)) for i, p in enumerate(prompts)]
    got = run_to_completion(tight, {0: [requests[0]], 3: requests[1:]})
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens >= 2 * 96
    for i, request in enumerate(requests):
        want = _run_one(plain, request.request_id, prompts[i], 64)
        want_trace, got_trace = trace_from_outputs(want), trace_from_outputs(got[request.request_id])
        assert_same_output(want_trace, got_trace, exact=False, label=f"chunked {i}")
    tight.allocator.check()
