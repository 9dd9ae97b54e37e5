"""The scheduler alone (no model): admission, budgets, preemption order, remote-KV rule."""

from engine.block_allocator import BlockAllocator
from engine.scheduler import Scheduler, SeqStatus, SequenceState


def _sched(num_blocks=8, block_size=4, budget=64, max_seqs=8, chunked=False, recompute_remote=False):
    return Scheduler(BlockAllocator(num_blocks, block_size), max_seqs, budget, chunked, recompute_remote)


def _seq(rid, n, remote=False):
    return SequenceState(rid, list(range(1, n + 1)), n, remote_kv=remote)


def _advance(sched, plan, new_token=7):
    """What the engine does after a step: count computed tokens, append a sampled token."""
    for seq, chunk in zip(plan.scheduled, plan.chunks):
        seq.num_computed_tokens += len(chunk.token_ids)
        if chunk.sample:
            seq.token_ids.append(new_token)


def test_admission_allocates_exact_blocks_and_builds_plan():
    sched = _sched()
    a, b = _seq("a", 5), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(c.request_id, c.start_pos, len(c.token_ids), c.block_ids, c.sample) for c in plan.chunks] == [
        ("a", 0, 5, (0, 1), True),
        ("b", 0, 3, (2,), True),
    ]
    _advance(sched, plan)
    plan = sched.schedule()
    assert [(c.request_id, c.token_ids, c.start_pos, c.block_ids) for c in plan.chunks] == [
        ("a", (7,), 5, (0, 1)),
        ("b", (7,), 3, (2,)),
    ]
    _advance(sched, plan)
    plan = sched.schedule()  # b's 5th token needs a second block
    assert plan.chunks[1].block_ids == (2, 3)


def test_chunked_prefill_splits_by_budget():
    sched = _sched(num_blocks=16, budget=6, chunked=True)
    sched.add(_seq("a", 10))
    plan = sched.schedule()
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in plan.chunks] == [(0, 6, False)]
    _advance(sched, plan)
    plan = sched.schedule()
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in plan.chunks] == [(6, 4, True)]


def test_without_chunking_a_prompt_over_the_remaining_budget_waits():
    sched = _sched(num_blocks=16, budget=8)
    sched.add(_seq("a", 6))
    sched.add(_seq("b", 5))
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_max_num_seqs():
    sched = _sched(num_blocks=16, max_seqs=2)
    for rid in "abc":
        sched.add(_seq(rid, 2))
    assert [c.request_id for c in sched.schedule().chunks] == ["a", "b"]


def test_preempts_newest_and_recomputes_it_first():
    sched = _sched(num_blocks=4, block_size=4)
    a, b = _seq("a", 8), _seq("b", 8)
    sched.add(a)
    sched.add(b)
    _advance(sched, sched.schedule())  # a: blocks 0,1  b: blocks 2,3, both have 9 tokens
    plan = sched.schedule()
    assert plan.preempted == ("b",)
    assert [c.request_id for c in plan.chunks] == ["a"] and plan.chunks[0].block_ids == (0, 1, 2)
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert sched.waiting[0] is b
    assert sched.allocator.num_free_blocks == 1


def test_remote_kv_sequence_stalls_instead_of_being_recomputed():
    sched = _sched(num_blocks=4, block_size=4)
    local, remote = _seq("local", 8), _seq("remote", 8, remote=True)
    sched.add(local)
    sched.add(remote)
    _advance(sched, sched.schedule())
    # both want a third block: the remote one is newer but may not be a victim, so the
    # local one preempts itself and the remote one proceeds
    plan = sched.schedule()
    assert plan.preempted == ("local",)
    assert [c.request_id for c in plan.chunks] == ["remote"]


def test_all_remote_and_stuck_recomputes_the_newest_here_and_both_finish():
    sched = _sched(num_blocks=4, block_size=4)
    a, b = _seq("a", 8, remote=True), _seq("b", 8, remote=True)
    for seq in (a, b):
        seq.block_ids = sched.allocator.allocate(2)
        seq.num_computed_tokens = 8
        seq.token_ids.append(7)
        sched.running.append(seq)
        seq.status = SeqStatus.RUNNING
    plan = sched.schedule()
    assert (plan.chunks, plan.preempted) == ((), ("b",))  # nothing could run: b gives its blocks
    assert list(sched.waiting) == [b] and (b.block_ids, b.num_computed_tokens, b.remote_kv) == ([], 0, False)
    plan = sched.schedule()  # a grows into b's blocks; b waits for room to recompute
    assert [(c.request_id, c.start_pos, c.block_ids) for c in plan.chunks] == [("a", 8, (0, 1, 2))]
    _advance(sched, plan)
    sched.remove(a)
    plan = sched.schedule()  # a is done: b is recomputed here, prompt and its sampled token
    assert [(c.request_id, c.start_pos, len(c.token_ids), c.sample) for c in plan.chunks] == [("b", 0, 9, True)]
    assert sched.num_preemptions == 1


def test_remote_kv_recompute_when_configured():
    sched = _sched(num_blocks=4, block_size=4, recompute_remote=True)
    a, b = _seq("a", 8), _seq("b", 8, remote=True)
    sched.add(a)
    sched.add(b)
    _advance(sched, sched.schedule())
    assert sched.schedule().preempted == ("b",)
