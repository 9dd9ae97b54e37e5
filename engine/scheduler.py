"""Continuous-batching scheduler: decides which tokens run this step. No torch.

Every step, running sequences go first (one decode token each, or the next prompt chunk),
then waiting sequences are admitted in FIFO order while the token budget
(``max_num_batched_tokens``), ``max_num_seqs`` and free blocks allow. Requests join and
leave the batch at every step.

Preemption (blocks ran out while a running sequence needs one more):
  * the victim is the most recently admitted running sequence not yet scheduled this step;
    it loses its blocks and goes back to the head of the waiting queue, to be recomputed
    (prompt + tokens generated so far) when blocks free up;
  * a sequence whose KV came from another replica (``remote_kv``) is not a victim unless
    ``recompute_remote_kv`` is set: re-running a long prefill on a decode replica is what
    disaggregation exists to avoid. Such a sequence that cannot grow *stalls* (keeps its
    blocks, skips the step) while others run and finish;
  * if a step would schedule nothing while sequences are stalled, the newest stalled
    sequence is preempted after all, to be recomputed here once blocks free up (from then on
    its KV is this replica's own). So the engine never deadlocks and no request fails for
    want of blocks: EngineConfig refuses a pool that cannot hold one request of
    ``max_model_len`` tokens, so a preempted sequence fits once the others are done.

Speculative proposals (``SequenceState.draft_tokens``, set by the engine before a step) ride
after a decoding sequence's last token in its chunk when the budget and free blocks allow
them without preempting anyone; otherwise the sequence decodes one token as usual.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engine.block_allocator import BlockAllocator, hash_blocks


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SequenceState:
    """Scheduling state of one request. ``token_ids`` is prompt + generated tokens."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    remote_kv: bool = False
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at first admission
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    draft_tokens: tuple[int, ...] = ()  # speculative proposals for the next step (engine.speculative)
    whole_prompt: bool = False  # every prompt position computed here (its logits are scored): no cached prefix

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's work in one step (the scheduler's plan, the runner's input).

    ``token_ids`` run at positions ``start_pos ..``; ``block_ids`` is the sequence's block
    table and covers at least ``start_pos + len(token_ids)`` tokens. ``sample`` is set
    when the chunk reaches the sequence's last known token, so its logits pick the next::

        token_ids of the sequence:  [p0 p1 p2 p3 p4 | g0 g1]   (prompt | generated)
        num_computed_tokens = 6                 ^ start_pos = 6, chunk = (g1,), sample
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    in_prompt: bool = False  # it computes prompt tokens (a one-token chunk after a cached prefix too)
    num_draft: int = 0  # the last ``num_draft`` tokens are proposals: logits at each of them and before

    @property
    def num_sampled(self) -> int:
        """Logits rows this chunk needs: its last token's, and one per proposal."""
        return self.num_draft + 1 if self.sample else 0

    @property
    def is_decode(self) -> bool:
        """One query token over cached context: the decode attention path (also the last prompt
        token after a cached prefix, which that path computes the same way)."""
        return len(self.token_ids) == 1 and self.start_pos > 0


@dataclass(frozen=True)
class SchedulerPlan:
    chunks: tuple[ScheduledChunk, ...]
    scheduled: tuple[SequenceState, ...]
    preempted: tuple[str, ...]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        recompute_remote_kv: bool = False,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.recompute_remote_kv = recompute_remote_kv
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (first admissions)
        self.prefix_hit_tokens = 0  # ... found there

    def add(self, seq: SequenceState) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens of waiting and running sequences not computed yet."""
        return sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in (*self.waiting, *self.running))

    def remove(self, seq: SequenceState, free_blocks: bool = True) -> list[int]:
        """Take a sequence out of the queues; returns its blocks (freed unless told not to)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        block_ids, seq.block_ids = seq.block_ids, []
        if free_blocks:
            self.allocator.free(block_ids)
        return block_ids

    def schedule(self) -> SchedulerPlan:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: list[SequenceState] = []
        preempted: list[str] = []
        stalled: list[SequenceState] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._grow(seq, seq.num_computed_tokens + n, scheduled, preempted):
                drafts = self._fit_drafts(seq, n, budget - n)
                chunks.append(self._chunk(seq, n, drafts))
                scheduled.append(seq)
                budget -= n + len(drafts)
            elif seq.status is SeqStatus.RUNNING:
                stalled.append(seq)
            else:
                continue  # seq preempted itself: running[i] is now the next one
            i += 1
        if not preempted:
            budget = self._admit(budget, chunks, scheduled)
        if not chunks and stalled:  # nothing can run: the newest stalled one is recomputed here
            victim = stalled[-1]
            victim.remote_kv = False  # recomputed, its KV is this replica's own
            self._preempt(victim)
            preempted.append(victim.request_id)
        return SchedulerPlan(tuple(chunks), tuple(scheduled), tuple(preempted))

    def _admit(self, budget: int, chunks: list[ScheduledChunk], scheduled: list[SequenceState]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            shared = self._share_cached_prefix(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget and self.enable_chunked_prefill:
                n = budget
            needed = self.allocator.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_ids)
            if n > budget or not self.allocator.can_allocate(needed):
                self._unshare(seq, shared)
                break
            self._count_prefix(seq, len(shared))
            seq.block_ids.extend(self.allocator.allocate(needed))
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            scheduled.append(seq)
            budget -= n
        return budget

    # ---- prefix caching ----------------------------------------------------------------

    def keys(self, seq: SequenceState, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of ``seq``'s first ``num_blocks`` full blocks (computed once)."""
        have, size = len(seq.block_keys), self.allocator.block_size
        if have < num_blocks:
            parent = seq.block_keys[-1] if have else b""
            seq.block_keys += hash_blocks(seq.token_ids[have * size : num_blocks * size], size, parent)
        return seq.block_keys[:num_blocks]

    def _share_cached_prefix(self, seq: SequenceState) -> list[int]:
        """Give a sequence with no blocks the cached blocks of its leading full blocks (at
        least its last token is left to compute: its logits pick the next token)."""
        allocator = self.allocator
        if not allocator.enable_caching or seq.block_ids or seq.remote_kv or seq.whole_prompt:
            return []
        matched = allocator.match_prefix(self.keys(seq, seq.num_tokens // allocator.block_size))
        if len(matched) * allocator.block_size >= seq.num_tokens:
            matched = matched[:-1]
        allocator.share(matched)
        seq.block_ids = list(matched)
        seq.num_computed_tokens = seq.num_registered_blocks = len(matched)
        seq.num_computed_tokens *= allocator.block_size
        return matched

    def _unshare(self, seq: SequenceState, shared: list[int]) -> None:
        """Undo ``_share_cached_prefix`` for a sequence that could not be admitted now."""
        if shared:
            self.allocator.free(shared)
            seq.block_ids, seq.num_computed_tokens, seq.num_registered_blocks = [], 0, 0

    def _count_prefix(self, seq: SequenceState, num_shared: int) -> None:
        if not self.allocator.enable_caching or seq.remote_kv or seq.num_preemptions or seq.whole_prompt:
            return  # a recompute after preemption, or a prompt computed whole, is not a prompt lookup
        seq.num_cached_tokens = num_shared * self.allocator.block_size
        self.prefix_query_tokens += seq.num_prompt_tokens
        self.prefix_hit_tokens += seq.num_cached_tokens

    def cache_computed(self, seq: SequenceState) -> None:
        """Put ``seq``'s newly computed full blocks into the prefix cache (after a step, or
        once KV from another replica is in place)."""
        if not self.allocator.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.allocator.block_size, len(seq.block_ids))
        if full <= seq.num_registered_blocks:
            return
        keys = self.keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_ids[i], keys[i])
        seq.num_registered_blocks = full

    def _grow(self, seq: SequenceState, num_tokens: int, scheduled: list[SequenceState], preempted: list[str]) -> bool:
        """Make ``seq``'s blocks cover ``num_tokens``, preempting newer sequences if needed."""
        needed = self.allocator.blocks_needed(num_tokens) - len(seq.block_ids)
        while not self.allocator.can_allocate(needed):
            victim = self._pick_victim(seq, scheduled)
            if victim is None:
                if self._preemptible(seq):
                    self._preempt(seq)
                    preempted.append(seq.request_id)
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
        seq.block_ids.extend(self.allocator.allocate(needed))
        return True

    def _fit_drafts(self, seq: SequenceState, n: int, budget: int) -> tuple[int, ...]:
        """The proposals that fit the budget and the free blocks (taken now), for a sequence that
        decodes one token this step; () otherwise."""
        drafts, seq.draft_tokens = seq.draft_tokens[: max(budget, 0)], ()
        if not drafts or n != 1:
            return ()
        needed = self.allocator.blocks_needed(seq.num_tokens + len(drafts)) - len(seq.block_ids)
        if not self.allocator.can_allocate(needed):
            return ()
        seq.block_ids.extend(self.allocator.allocate(needed))
        return drafts

    def rewind(self, seq: SequenceState) -> None:
        """Give back the blocks past what ``seq``'s computed tokens need (after rejected proposals)."""
        keep = self.allocator.blocks_needed(seq.num_computed_tokens)
        if len(seq.block_ids) > keep:
            self.allocator.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def _preemptible(self, seq: SequenceState) -> bool:
        return not seq.remote_kv or self.recompute_remote_kv

    def _pick_victim(self, seq: SequenceState, scheduled: list[SequenceState]) -> SequenceState | None:
        for candidate in reversed(self.running):
            if candidate is not seq and candidate not in scheduled and self._preemptible(candidate):
                return candidate
        return None

    def _preempt(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = seq.num_registered_blocks = 0
        seq.draft_tokens = ()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _chunk(self, seq: SequenceState, n: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=tuple(seq.token_ids[start : start + n]) + drafts,
            start_pos=start,
            block_ids=tuple(seq.block_ids),
            sample=start + n == seq.num_tokens,
            in_prompt=start < seq.num_prompt_tokens,
            num_draft=len(drafts),
        )
