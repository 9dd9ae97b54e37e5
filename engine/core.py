"""EngineCore: the synchronous engine. One ``step()`` = schedule, run the model, sample.

Entry points by role (``engine.params.Role``):
  * ``add_request``  (roles decode, both): the whole request here;
  * ``add_prefill``  (roles prefill, both): stop after the first token; the prompt's blocks
    stay pinned until ``release`` (the KV transport reads them from there);
  * ``reserve`` then ``add_decode`` (roles decode, both): hold blocks while KV arrives from
    elsewhere, then continue from that KV and the first token.
The role only gates new admissions; work already admitted finishes when it changes.

Preemption of a request whose KV came from elsewhere: see ``engine.scheduler`` (never
recomputed here unless ``EngineConfig.recompute_remote_kv``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.block_allocator import BlockAllocator, BlockAllocatorError, hash_blocks
from engine.config import EngineConfig, resolve_limits
from engine.detokenizer import TextStream
from engine.kv_pool import layout_for
from engine.loader import LoadedModel, ModelSpec, load_model
from engine.model_runner import PromptScores
from engine.overlap import PLACEHOLDER, FedTokens, InFlight
from engine.params import (
    ContextLimits,
    EngineStats,
    FinishReason,
    GenerationRequest,
    KVReport,
    RequestOutput,
    Role,
    RoleError,
    SamplingParams,
    TokenLogprobs,
    check_fits,
)
from engine.sampling import (
    TokenHistory,
    apply_allowed_tokens,
    apply_logit_bias,
    apply_penalties,
    batch_logprobs,
    on_device,
    sample_batch,
    sample_tokens,
    token_logprobs,
)
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerPlan, SequenceState
from engine.speculative import SpecCounters, SpecState, propose_ngram
from engine.structured import GrammarCache, GrammarMatcher, apply_grammar_masks
from engine.tensor_parallel import HEARTBEAT_S, check_degree, shard_for
from engine.tokenization import ChatMessage, encode_prompt, eos_token_ids
from engine.tp_worker import Launcher, Leader, build_rank, local_launcher

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    request: GenerationRequest
    seq: SequenceState
    stream: TextStream
    generator: torch.Generator | None
    prefill_only: bool
    admitted_at: float = 0.0  # perf_counter when admitted
    scheduled_at: float | None = None  # when its first prompt chunk ran
    # sampling state rebuilt from the request and its tokens (so a decode replica rebuilds it)
    history: TokenHistory | None = None  # token counts, for penalties
    grammar: GrammarMatcher | None = None  # response_format's position, advanced by each token
    spec: SpecState | None = None  # speculative decoding's recent acceptance (None: it never proposes)
    in_flight: int = 0  # placeholders ending ``seq.token_ids``: sampled in steps not landed (engine.overlap)
    prompt_scores: list[TokenLogprobs] | None = None  # ``prompt_logprobs``: prompt tokens 1.. scored so far
    allowed: torch.Tensor | None = None  # ``allowed_token_ids`` on the device (built once, used every step)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated and known on the host (placeholders not counted)."""
        return self.seq.num_output_tokens - self.in_flight

    @property
    def plain(self) -> bool:
        """Its sampling needs nothing from its tokens on the host (``engine.overlap``)."""
        host_state = (self.history, self.grammar, self.spec)
        bad_words = self.request.sampling.bad_words_token_ids  # matched against the tokens so far
        return not self.prefill_only and all(s is None for s in host_state) and not bad_words


def _ends_with(tokens: list[int], tail: tuple[int, ...]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tuple(tokens[-len(tail) :]) == tail)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, launch: Launcher | None = None) -> None:
        """``launch`` starts ranks 1.. of a tensor-parallel engine (``engine.tp_worker``)."""
        config = config or EngineConfig()
        self.config = config
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        model = loaded.model
        self.device = model.device
        self.model_config = model.config
        degree = config.tensor_parallel_size
        if degree > 1:
            check_degree(model.config, degree)
            if launch is None:
                raise ValueError("tensor_parallel_size > 1 needs a launcher for its other ranks (EngineCore.from_spec)")
        shard = shard_for(model.config, 0, degree) if degree > 1 else None
        self.layout = layout_for(model.config, config.block_size, model.dtype, shard)  # this rank's KV heads
        self.vocab_size = model.get_input_embeddings().num_embeddings  # ids at or above: refused
        self.limits = resolve_limits(config, model.config.max_position_embeddings, self.layout.bytes_per_block)
        self.allocator = BlockAllocator(self.limits.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            self.limits.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.recompute_remote_kv,
        )
        # every rank builds from these settings, its pool as many blocks as this one
        rank_config = config.model_copy(update={"num_blocks": self.limits.num_blocks})
        self.tp = Leader(self.device, degree, rank_config, launch) if degree > 1 else None
        try:
            self.runner = build_rank(model, rank_config, 0, None if self.tp is None else self.tp.group)
        except BaseException:
            if self.tp is not None:
                self.tp.ready(False)
            raise
        if self.tp is not None:
            self.tp.ready(True)
        self.pool = self.runner.pool
        self.role = config.role
        if config.speculative.enabled and self.device.type == "cuda":
            logger.warning(
                "speculative decoding on CUDA: verify steps replay from CUDA graphs of the model's "
                "own forward, not the fused decode kernels, and cost more than a plain step; it "
                "pays only where enough proposals are accepted (docs/benchmarks/gpu.md)"
            )
        self._eos_ids = eos_token_ids(model, self.tokenizer)
        self._requests: dict[str, _Request] = {}
        self._pinned: dict[str, list[int]] = {}
        self._reserved: dict[str, list[int]] = {}
        self._held_since: dict[str, float] = {}  # pinned or reserved request -> since (monotonic)
        self._pending: list[RequestOutput] = []
        self._inflight: InFlight | None = None  # a launched step not landed yet (engine.overlap)
        self._last_landed = 0.0  # perf_counter when the last step in flight landed
        self.num_landings = 0  # steps in flight landed (each is a step that made progress)
        # sampling runs where the logits are, so the generators live on the model's device
        self._default_generator = torch.Generator(device=self.device).manual_seed(random.getrandbits(63))
        self._ids = itertools.count()
        self._step_times: deque[float] = deque(maxlen=64)  # seconds of recent steps that ran the model
        self.num_model_steps = 0  # steps that ran the model (a step may run none: all waiting for blocks)
        self.spec_counters = SpecCounters()

    @classmethod
    def from_spec(
        cls, spec: ModelSpec | None = None, config: EngineConfig | None = None, launch: Launcher | None = None
    ) -> EngineCore:
        """A tensor-parallel engine's other ranks load ``spec`` (default: in local processes)."""
        spec = spec or ModelSpec()
        return cls(load_model(spec), config, launch or local_launcher(spec))

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (nothing to do otherwise)."""
        if self.tp is not None:
            self.tp.close()

    def health_problem(self) -> str | None:
        """Why this engine cannot step (a tensor-parallel rank is gone); None when it can."""
        return None if self.tp is None else self.tp.problem()

    def ranks(self) -> list[dict[str, object]]:
        """Each rank of this engine (one without tensor parallelism): its pid, the model's KV heads
        its pool holds, and the pool's bytes (every rank's pool has the same blocks)."""
        degree = self.config.tensor_parallel_size
        pids = [os.getpid(), *([] if self.tp is None else self.tp.pids)]
        pool_bytes = self.limits.num_blocks * self.layout.bytes_per_block
        ranks = []
        for rank, pid in enumerate(pids):
            heads = shard_for(self.model_config, rank, degree).kv_head_range
            ranks.append({"rank": rank, "pid": pid, "kv_heads": [heads.start, len(heads)], "pool_bytes": pool_bytes})
        return ranks

    @property
    def idle_interval_s(self) -> float | None:
        """How often ``idle`` wants calling while nothing runs (None: never)."""
        return None if self.tp is None else HEARTBEAT_S

    def idle(self) -> None:
        """Called every ``tensor_parallel.HEARTBEAT_S`` while nothing runs: keeps the ranks waiting."""
        if self.tp is not None:
            self.tp.heartbeat()

    # ---- requests -------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[ChatMessage] | list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerationRequest:
        """Tokenize a text prompt, or a chat (list of messages) through the chat template."""
        ids = encode_prompt(self.tokenizer, prompt)
        return GenerationRequest(request_id or f"req-{next(self._ids)}", tuple(ids), sampling or SamplingParams())

    def add_request(self, request: GenerationRequest) -> None:
        self._require_role(Role.DECODE, "generate")
        self._admit(request, prefill_only=False, remote_blocks=None)

    def add_prefill(self, request: GenerationRequest) -> None:
        self._require_role(Role.PREFILL, "prefill")
        self._admit(request, prefill_only=True, remote_blocks=None)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Hold blocks for ``num_tokens`` tokens of a request whose KV will arrive; None if full."""
        self._check_reservable(request_id, num_tokens)
        needed = self.allocator.blocks_needed(num_tokens)
        if not self.allocator.can_allocate(needed):
            return None
        self._reserved[request_id] = self.allocator.allocate(needed)
        self._held_since[request_id] = time.monotonic()
        return list(self._reserved[request_id])

    def reserve_prefix(self, request_id: str, prompt_token_ids: Sequence[int]) -> tuple[list[int], int] | None:
        """``reserve`` for a prompt's KV, sharing the leading full blocks this replica's prefix
        cache already holds: (the blocks, how many leading ones hold their KV already, which
        the transport then skips); None if full."""
        num_tokens = len(prompt_token_ids)
        self._check_reservable(request_id, num_tokens)
        allocator = self.allocator
        shared = allocator.match_prefix(hash_blocks(prompt_token_ids, allocator.block_size))
        allocator.share(shared)  # an evictable block taken back no longer counts as free
        needed = allocator.blocks_needed(num_tokens) - len(shared)
        if not allocator.can_allocate(needed):
            allocator.free(shared)
            return None
        self._reserved[request_id] = shared + allocator.allocate(needed)
        self._held_since[request_id] = time.monotonic()
        if allocator.enable_caching:  # counted as this replica's lookups (the KV it did not move)
            self.scheduler.prefix_query_tokens += num_tokens
            self.scheduler.prefix_hit_tokens += len(shared) * allocator.block_size
        return list(self._reserved[request_id]), len(shared)

    def _check_reservable(self, request_id: str, num_tokens: int) -> None:
        self._require_role(Role.DECODE, "reserve")
        if request_id in self._reserved or request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} already exists on this engine")
        if not 1 <= num_tokens <= self.limits.max_model_len:
            raise ValueError(f"num_tokens must be in [1, {self.limits.max_model_len}], got {num_tokens}")

    def add_decode(
        self,
        request: GenerationRequest,
        block_ids: list[int],
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
    ) -> None:
        """Continue ``request`` from KV already written into ``block_ids`` (from ``reserve``).
        ``first_logprobs``: the first token's, computed where the prompt ran (this engine has
        no logits for it)."""
        self._require_role(Role.DECODE, "decode")
        held = self._reserved.get(request.request_id)
        if held is None or list(block_ids) != held:
            raise ValueError(f"block_ids {list(block_ids)} were not reserved for {request.request_id!r}")
        self._admit(request, prefill_only=False, remote_blocks=held)
        del self._reserved[request.request_id]
        self._held_since.pop(request.request_id, None)
        self.scheduler.cache_computed(self._requests[request.request_id].seq)  # the prefix this replica now holds
        self._pending.append(self._append_token(self._requests[request.request_id], first_token, first_logprobs))

    def release(self, request_id: str) -> bool:
        """Free the pinned blocks of a finished prefill, or reserved blocks never used."""
        blocks = self._pinned.pop(request_id, None) or self._reserved.pop(request_id, None)
        if blocks is None:
            return False
        self._held_since.pop(request_id, None)
        self.allocator.free(blocks)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop everything the request holds (running, waiting, pinned or reserved)."""
        state = self._requests.get(request_id)
        if state is not None:
            self._pending.append(self._finish(state, FinishReason.ABORT, "", ()))
            return True
        return self.release(request_id)

    def abort_all(self) -> None:
        """Abort every request and drop pinned and reserved blocks (after a failed step). On
        CUDA it first waits for the device: a step still queued there may write their blocks."""
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):  # a failed step: its blocks are freed all the same
                torch.cuda.synchronize(self.device)
        inflight, self._inflight = self._inflight, None
        for request_id in [*self._requests, *self._pinned, *self._reserved]:
            self.abort(request_id)
        self._pending.clear()
        if inflight is not None:
            self.allocator.free(inflight.free_after)

    def set_role(self, role: Role) -> None:
        self.role = Role(role)

    def _require_role(self, accepted: Role, what: str) -> None:
        if self.role not in (accepted, Role.BOTH):
            raise RoleError(f"engine in role {self.role.value!r} does not accept {what} requests")

    def _admit(self, request: GenerationRequest, prefill_only: bool, remote_blocks: list[int] | None) -> None:
        rid = request.request_id
        if rid in self._requests or rid in self._pinned:
            raise ValueError(f"request_id {rid!r} already exists on this engine")
        self._validate_length(request)
        sp = request.sampling
        sp.check_token_ids(self.vocab_size)
        grammar = self.grammars.matcher(*sp.grammar, field=sp.grammar_field) if sp.grammar is not None else None
        prompt = list(request.prompt_token_ids)
        scored = sp.prompt_logprobs is not None
        if scored and (prefill_only or remote_blocks is not None):
            raise ValueError("prompt_logprobs: the whole request runs on one engine, which computes its prompt")
        seq = SequenceState(rid, prompt, len(prompt), remote_kv=remote_blocks is not None, whole_prompt=scored)
        if remote_blocks is not None:
            seq.block_ids = list(remote_blocks)
            seq.num_computed_tokens = len(prompt)
        generator = None
        if sp.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sp.seed)
        elif not sp.greedy:
            generator = self._default_generator
        stream = TextStream(self.tokenizer, prompt, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens)
        history = TokenHistory.build(sp, prompt, self.device)
        spec = SpecState() if self.config.speculative.enabled and not prefill_only else None
        admitted = time.perf_counter()
        allowed = on_device(sp.allowed_token_ids, self.device) if sp.allowed_token_ids else None
        self._requests[rid] = _Request(
            request, seq, stream, generator, prefill_only, admitted, history=history, grammar=grammar, spec=spec,
            prompt_scores=[] if scored else None, allowed=allowed,
        )  # fmt: skip
        self.scheduler.add(seq)

    @functools.cached_property
    def grammars(self) -> GrammarCache:
        """This engine's compiled response_format grammars, by schema (built on first use)."""
        return GrammarCache(self.tokenizer, self.vocab_size, self._eos_ids)

    def _validate_length(self, request: GenerationRequest) -> None:
        """Ids and lengths the model can take, checked before anything is allocated."""
        limits = ContextLimits(max_model_len=self.limits.max_model_len, vocab_size=self.vocab_size)
        check_fits(request.prompt_token_ids, request.sampling.max_tokens, limits)

    # ---- the step ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._pending) or self._inflight is not None or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, sample; returns what each touched request produced.

        Outputs made between steps (a decode's first token from ``add_decode``) are returned
        by a step of their own, without running the model, so they never wait for a forward pass.
        With asynchronous scheduling (``engine.overlap``) a decode step may be left in flight:
        it returns nothing, and the next ``step()`` launches the one after before returning
        its outputs.
        """
        if self._pending:
            outputs, self._pending = self._pending, []
            return outputs
        if self._inflight is not None:
            return self._step_ahead()
        self._propose()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        start = time.perf_counter()
        scores = self._prompt_scores(plan.chunks)
        logits = self._execute(plan.chunks, scores)
        for request_id, scored in scores.items():
            self._requests[request_id].prompt_scores += scored.found
        self._count_computed(plan, start, cache=True)
        sampled = [c for c in plan.chunks if c.sample]
        if self._may_overlap(plan):
            self._launch(logits, sampled, start)
            return []
        outputs = self._sample(logits, sampled)
        self._step_times.append(time.perf_counter() - start)
        self.num_model_steps += 1
        return outputs

    def _prompt_scores(self, chunks: Sequence[ScheduledChunk]) -> dict[str, PromptScores]:
        """The prompt rows to score in this step: of each request asking ``prompt_logprobs``,
        position p of its chunk scores prompt token p + 1, once (a recompute after preemption
        repeats nothing)."""
        wanted = {}
        for chunk in chunks:
            if not chunk.in_prompt:  # a decode step looks nothing up
                continue
            state = self._requests[chunk.request_id]
            if state.prompt_scores is None:
                continue
            prompt, done = state.request.prompt_token_ids, len(state.prompt_scores)
            first, end = max(chunk.start_pos, done), min(chunk.start_pos + len(chunk.token_ids), len(prompt) - 1)
            if first > done:
                raise RuntimeError(f"{chunk.request_id}: prompt positions {done}..{first - 1} were not computed here")
            if end > first:
                targets = tuple(prompt[first + 1 : end + 1])
                wanted[chunk.request_id] = PromptScores(
                    first - chunk.start_pos, targets, state.request.sampling.prompt_logprobs
                )
        return wanted

    def _count_computed(self, plan: SchedulerPlan, start: float, cache: bool) -> None:
        """After a step's forward: its tokens' KV is computed (proposals: once accepted), the
        full blocks go to the prefix cache (``cache``: not while a placeholder is in them)."""
        for seq, chunk in zip(plan.scheduled, plan.chunks):
            seq.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft
            if cache and not chunk.num_draft:
                self.scheduler.cache_computed(seq)
            state = self._requests[chunk.request_id]
            if state.scheduled_at is None:
                state.scheduled_at = start

    # ---- asynchronous scheduling (engine.overlap) --------------------------------------

    def _overlap_enabled(self) -> bool:
        mode = self.config.async_scheduling
        if mode == "off" or self.tp is not None or self.config.speculative.enabled:
            return False
        return mode == "on" or self.runner.graphs is not None

    def _may_overlap(self, plan: SchedulerPlan) -> bool:
        """Whether this step may stay in flight: every running request decodes one token in
        it, with a sampling that needs nothing from the host, and no waiting request could be
        admitted next."""
        scheduler = self.scheduler
        if not self._overlap_enabled() or plan.preempted or self._admissible():
            return False
        if len(plan.chunks) != len(scheduler.running):
            return False
        return all(
            c.is_decode and c.sample and not c.in_prompt and not c.num_draft and self._requests[c.request_id].plain
            for c in plan.chunks
        )

    def _admissible(self) -> bool:
        """A request waits that the next step might admit (none while ``max_num_seqs`` run)."""
        return bool(self.scheduler.waiting) and len(self.scheduler.running) < self.scheduler.max_num_seqs

    def _may_continue(self, landing: InFlight) -> bool:
        """Whether the next step may be launched before ``landing``'s tokens are read: no
        waiting request could be admitted, every running request was sampled in ``landing`` (so
        its next token is there), one at least may go on past it, and the step takes no block
        from anyone."""
        scheduler, running = self.scheduler, self.scheduler.running
        if not self._overlap_enabled() or self._admissible() or not running:
            return False
        if len(running) > scheduler.max_num_batched_tokens:
            return False
        states = [self._requests[seq.request_id] for seq in running]
        if any(id(state) not in landing.row_of for state in states):
            return False
        if all(s.seq.num_output_tokens >= s.request.sampling.max_tokens for s in states):
            return False  # each ends when its token lands
        needed = sum(self.allocator.blocks_needed(seq.num_tokens) - len(seq.block_ids) for seq in running)
        return self.allocator.can_allocate(needed)

    def _step_ahead(self) -> list[RequestOutput]:
        """With a step in flight: launch the next one if the batch allows (its tokens fed on the
        device from the one in flight), then land the one in flight."""
        landing, self._inflight = self._inflight, None
        try:
            if self._may_continue(landing):
                plan = self.scheduler.schedule()
                if plan.preempted or len(plan.chunks) != len(self.scheduler.running):
                    raise RuntimeError(f"a step scheduled ahead must decode every request once: {plan}")
                start = time.perf_counter()
                rows = [landing.row_of[id(self._requests[c.request_id])] for c in plan.chunks]
                logits = self.runner.execute(plan.chunks, FedTokens(landing.tokens, rows))
                self._count_computed(plan, start, cache=False)  # cached as their tokens land
                self._launch(logits, list(plan.chunks), start)
        except BaseException:
            self._inflight = landing  # ``abort_all`` waits for it and frees what waited for it
            raise
        return self._land(landing)

    def _launch(self, logits: torch.Tensor, chunks: list[ScheduledChunk], start: float) -> None:
        """Sample ``chunks``' tokens on the device and leave the step in flight: each request
        holds a placeholder until they land."""
        states = [self._requests[c.request_id] for c in chunks]
        processed = self._processed_logits(logits, states)
        tokens = sample_tokens(processed, [s.request.sampling for s in states], [s.generator for s in states])
        num_top = [s.request.sampling.logprobs for s in states if s.request.sampling.logprobs is not None]
        logprobs = batch_logprobs(logits, tokens, max(num_top)) if num_top else ()  # raw logits, as ``_sample``
        for state in states:
            state.seq.token_ids.append(PLACEHOLDER)
            state.in_flight += 1
        self._inflight = InFlight.launch(states, tokens, logprobs, start)
        self.num_model_steps += 1

    def _land(self, landing: InFlight) -> list[RequestOutput]:
        """Wait for ``landing``'s tokens, free the blocks that waited for it, and append each
        token in its placeholder's place: the outputs of that step."""
        try:
            tokens, logprobs_of = landing.wait()
        finally:  # a failed step: its blocks go back all the same (the requests are aborted next)
            self.allocator.free(landing.free_after)
        self.num_landings += 1
        outputs = []
        for row, (state, token) in enumerate(zip(landing.states, tokens)):
            if self._requests.get(state.request.request_id) is not state:
                continue  # it ended while the step ran: aborted, or ended by its previous token
            seq = state.seq
            seq.token_ids[len(seq.token_ids) - state.in_flight] = token
            state.in_flight -= 1
            self.scheduler.cache_computed(seq)
            num_top = state.request.sampling.logprobs
            logprobs = logprobs_of(row, num_top) if num_top is not None else None
            outputs.append(self._took_token(state, token, logprobs))
        now = time.perf_counter()  # a step in flight took from its launch or the last landing, the later
        self._step_times.append(now - max(landing.started, self._last_landed))
        self._last_landed = now
        return outputs

    def _execute(self, chunks: Sequence[ScheduledChunk], scores: dict[str, PromptScores]) -> torch.Tensor:
        if self.tp is None:
            return self.runner.execute(chunks, scores=scores)
        self.tp.send(chunks)
        try:
            return self.runner.execute(chunks, scores=scores)
        except Exception as exc:  # a collective failed: the ranks are out of step for good
            raise self.tp.lost(exc) from exc

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Sample each chunk's next token; a chunk with proposals goes on position by position
        while the token sampled equals the proposal there (``engine.speculative``), each position
        sampled with the sampling state its accepted tokens left (penalties, grammar, stops)."""
        first, rows = 0, []  # (state, chunk, its first logits row)
        for chunk in chunks:
            rows.append((self._requests[chunk.request_id], chunk, first))
            first += chunk.num_sampled
        produced: dict[str, list[RequestOutput]] = {}
        position = 0
        while rows:
            states = [state for state, _, _ in rows]
            drafts = [c.token_ids[-c.num_draft + position] if position < c.num_draft else None for _, c, _ in rows]
            raw = logits if position == 0 and len(rows) == len(logits) else logits[[r + position for *_, r in rows]]
            processed = self._processed_logits(raw, states)  # raw logits stay: logprobs report them
            params, generators = [s.request.sampling for s in states], [s.generator for s in states]
            tokens = sample_batch(processed, params, generators, drafts)
            going = []
            for i, ((state, chunk, first_row), token) in enumerate(zip(rows, tokens)):
                num_top = state.request.sampling.logprobs
                logprobs = token_logprobs(raw[i], token, num_top) if num_top is not None else None
                output = self._append_token(state, token, logprobs)
                produced.setdefault(chunk.request_id, []).append(output)
                if drafts[i] is not None and token == drafts[i] and not output.finished:
                    going.append((state, chunk, first_row))
                elif chunk.num_draft and not output.finished:
                    self._settle(state, chunk, accepted=position)
                elif chunk.num_draft:  # ended inside its proposals: nothing to give back
                    self.spec_counters.add(chunk.num_draft, position + (token == drafts[i]))
            rows, position = going, position + 1
        return [_merged(outs) for outs in produced.values()]

    def _settle(self, state: _Request, chunk: ScheduledChunk, accepted: int) -> None:
        """After verifying ``chunk``'s proposals: the accepted ones' KV counts as computed, the
        blocks past it go back, and the request's acceptance is recorded."""
        seq = state.seq
        seq.num_computed_tokens += accepted
        self.scheduler.rewind(seq)
        self.scheduler.cache_computed(seq)
        self.spec_counters.add(chunk.num_draft, accepted)
        if state.spec is not None:
            state.spec.record(chunk.num_draft, accepted, self.num_model_steps)

    def _propose(self) -> None:
        """Speculative proposals for this step's decoding requests (``engine.speculative``): none
        in a batch above ``disable_by_batch_size``, none for a paused request, none past
        ``max_tokens`` (the step also samples one token of its own) or the context."""
        spec = self.config.speculative
        running = self.scheduler.running
        if not spec.enabled or not running or len(running) > spec.disable_by_batch_size:
            return
        for seq in running:
            state = self._requests[seq.request_id]
            if state.spec is None or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens or not state.spec.may_propose(self.num_model_steps):
                continue
            room = min(
                spec.num_speculative_tokens,
                state.request.sampling.max_tokens - seq.num_output_tokens - 1,
                self.limits.max_model_len - seq.num_tokens,
            )
            seq.draft_tokens = propose_ngram(seq.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, room)

    def _processed_logits(self, logits: torch.Tensor, sampled: list[_Request]) -> torch.Tensor:
        """What to sample from: a copy of ``logits`` with each row's ``allowed_token_ids``,
        ``logit_bias``, penalties, ``min_tokens`` hold-back and bad words, and grammar mask
        applied (in that order, see ``SamplingParams``),
        or ``logits`` itself when no row asks for any of it. Each is one batched op over the
        rows that ask for it."""
        params = [s.request.sampling for s in sampled]
        held = self._held_back(sampled)
        asked = (s.allowed is not None or p.logit_bias or s.history or s.grammar for p, s in zip(params, sampled))
        if not held and not any(asked):
            return logits
        with torch.inference_mode():  # logits is an inference tensor
            processed = logits.clone()
            apply_allowed_tokens(processed, [s.allowed for s in sampled])
            apply_logit_bias(processed, params)
            apply_penalties(processed, params, [s.history for s in sampled])
            if held:
                rows = on_device([row for row, ids in held for _ in ids], self.device)
                processed[rows, on_device([t for _, ids in held for t in ids], self.device)] = float("-inf")
            grammars = [s.grammar for s in sampled]
            if any(grammars):
                apply_grammar_masks(processed, grammars, self.grammars.executor)
        return processed

    def _held_back(self, sampled: list[_Request]) -> list[tuple[int, list[int]]]:
        """(row, ids) of tokens a row may not sample now (as vLLM's): EOS and stop token ids
        before ``min_tokens``, and the last token of each bad word the output ends with the rest of."""
        held = []
        for row, state in enumerate(sampled):
            sp, banned = state.request.sampling, []
            if state.seq.num_output_tokens < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self._eos_ids))
            if sp.bad_words_token_ids:  # matched against the output's tail, never the prompt
                ids, longest = state.seq.token_ids, max(map(len, sp.bad_words_token_ids)) - 1
                tail = ids[max(state.seq.num_prompt_tokens, len(ids) - longest) :]
                banned += [w[-1] for w in sp.bad_words_token_ids if _ends_with(tail, w[:-1])]
            if banned and sp.allowed_token_ids and set(banned).issuperset(sp.allowed_token_ids):
                continue  # none of the allowed tokens would be left: allowed_token_ids wins
            if banned:
                held.append((row, banned))
        return held

    def _append_token(self, state: _Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """Add one sampled token (or a decode's first token, sampled elsewhere): advance the
        request's sampling state by it, then end the request if it must end here."""
        state.seq.token_ids.append(token)
        return self._took_token(state, token, logprobs)

    def _took_token(self, state: _Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """``_append_token`` once the token is in ``seq.token_ids``."""
        sp = state.request.sampling
        lps = (logprobs,) if logprobs is not None else ()
        if state.history is not None:
            state.history.add(token)
        if state.grammar is not None and not state.grammar.advance(token):
            message = f"response_format: the grammar refused token {token}: {state.grammar.error}"
            return self._finish(state, FinishReason.ERROR, "", (token,), message, logprobs=lps)
        # a stop token's text is not output unless asked (as vLLM's); EOS, a special token, has none
        stop_id = token in sp.stop_token_ids or (token in self._eos_ids and not sp.ignore_eos)
        silent = stop_id and not sp.include_stop_str_in_output
        text, hit_stop = ("", False) if silent else state.stream.push(token)
        complete = state.grammar is not None and state.grammar.done
        if hit_stop or complete or stop_id:
            # the held-back tail too (nothing is held back after a stop string: it was cut there)
            return self._finish(state, FinishReason.STOP, text + state.stream.flush(), (token,), logprobs=lps)
        if state.num_output_tokens >= sp.max_tokens:
            return self._finish(state, FinishReason.LENGTH, text + state.stream.flush(), (token,), logprobs=lps)
        if state.prefill_only:
            return self._pin(state, text, token, lps)
        return self._output(state, (token,), text, False, None, lps)

    def _pin(self, state: _Request, text: str, token: int, lps: tuple[TokenLogprobs, ...]) -> RequestOutput:
        """End the prefill phase: the blocks move from the request to the pinned set."""
        rid = state.request.request_id
        self._pinned[rid] = self.scheduler.remove(state.seq, free_blocks=False)
        self._held_since[rid] = time.monotonic()
        del self._requests[rid]
        return self._output(state, (token,), text, True, None, lps, pinned=tuple(self._pinned[rid]))

    def _finish(
        self,
        state: _Request,
        reason: FinishReason,
        text: str,
        tokens: tuple[int, ...],
        error: str | None = None,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> RequestOutput:
        if state.in_flight:  # tokens sampled after this one are dropped
            del state.seq.token_ids[-state.in_flight :]
            state.in_flight = 0
        blocks = self.scheduler.remove(state.seq, free_blocks=False)
        if self._inflight is not None and self._inflight.holds(state):
            self._inflight.free_after += blocks  # the device may still write its K/V
        else:
            self.allocator.free(blocks)
        del self._requests[state.request.request_id]
        return self._output(state, tokens, text, True, reason, logprobs, error=error)

    def _output(
        self,
        state: _Request,
        tokens: tuple[int, ...],
        text: str,
        finished: bool,
        reason: FinishReason | None,
        logprobs: tuple[TokenLogprobs, ...],
        error: str | None = None,
        pinned: tuple[int, ...] = (),
    ) -> RequestOutput:
        seq = state.seq
        timing, first = None, bool(tokens) and state.num_output_tokens == 1
        if first and state.scheduled_at is not None and not seq.remote_kv:
            timing = (state.scheduled_at - state.admitted_at, time.perf_counter() - state.scheduled_at)
        return RequestOutput(
            request_id=state.request.request_id,
            token_ids=tokens,
            text=text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            logprobs=logprobs,
            prompt_logprobs=tuple(state.prompt_scores) if first and state.prompt_scores is not None else None,
            error=error,
            pinned_block_ids=pinned,
            prefill_timing=timing,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ---- introspection ----------------------------------------------------------------

    def kv_report(self) -> KVReport:
        """The KV accounting with its invariants checked (``KVReport``): for ``GET /admin/kv``
        and the tests that assert nothing leaked after a failure."""
        allocator = self.allocator
        problems = []
        try:
            allocator.check()
        except BlockAllocatorError as exc:
            problems.append(str(exc))
        holders = [state.seq.block_ids for state in self._requests.values()]
        holders += [*self._pinned.values(), *self._reserved.values()]
        if self._inflight is not None:
            holders.append(self._inflight.free_after)  # ended requests' blocks, the step in flight's
        owners = Counter(block for blocks in holders for block in blocks)
        references = allocator.references()
        orphans = [b for b, count in enumerate(references) if count > owners[b]]
        if orphans:
            problems.append(f"{len(orphans)} block(s) in use by no live request, e.g. {orphans[:8]}")
        over = [b for b, count in owners.items() if count > references[b]]
        if over:
            problems.append(f"{len(over)} block(s) held more often than referenced, e.g. {over[:8]}")
        now = time.monotonic()
        pinned_ages = [now - self._held_since[r] for r in self._pinned if r in self._held_since]
        reserved_ages = [now - self._held_since[r] for r in self._reserved if r in self._held_since]
        in_use = sum(count > 0 for count in references)
        return KVReport(
            role=self.role,
            num_total_blocks=allocator.num_blocks,
            num_free_blocks=allocator.num_free_blocks - allocator.num_cached_blocks,
            num_cached_blocks=allocator.num_cached_blocks,
            num_in_use_blocks=in_use,
            num_pinned_blocks=sum(len(b) for b in self._pinned.values()),
            num_reserved_blocks=sum(len(b) for b in self._reserved.values()),
            num_requests=len(self._requests),
            num_pinned_requests=len(self._pinned),
            num_reserved_requests=len(self._reserved),
            oldest_pinned_s=max(pinned_ages, default=None),
            oldest_reserved_s=max(reserved_ages, default=None),
            problems=tuple(problems),
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            role=self.role,
            num_total_blocks=self.allocator.num_blocks,
            num_free_blocks=self.allocator.num_free_blocks,
            num_pinned_blocks=sum(len(b) for b in list(self._pinned.values())),
            num_reserved_blocks=sum(len(b) for b in list(self._reserved.values())),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            block_size=self.config.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            median_step_ms=statistics.median(self._step_times) * 1e3 if self._step_times else 0.0,
            num_decoding=sum(not state.prefill_only for state in list(self._requests.values())),
            num_queued_prompt_tokens=self.scheduler.num_queued_prompt_tokens(),
            num_cached_blocks=self.allocator.num_cached_blocks,
            prefix_query_tokens=self.scheduler.prefix_query_tokens,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            num_evictions=self.allocator.num_evictions,
            spec_drafts=self.spec_counters.num_drafts,
            spec_draft_tokens=self.spec_counters.num_draft_tokens,
            spec_accepted_tokens=self.spec_counters.num_accepted_tokens,
            tensor_parallel_size=self.config.tensor_parallel_size,
            tp_all_reduce_s=0.0 if self.tp is None else self.tp.group.reduce_s,
        )


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step as one (several tokens after accepted proposals)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(
        last,
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text="".join(o.text for o in outputs),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
        prompt_logprobs=outputs[0].prompt_logprobs,
        prefill_timing=outputs[0].prefill_timing,
    )
