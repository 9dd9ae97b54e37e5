"""Executes a scheduler plan: builds the packed tensors, runs the model, returns logits.

The model is the transformers model itself (any decoder-only family); only its attention
function is swapped for ``engine.attention.paged_attention_forward``. No HF cache object
is used: K/V live in the paged pool.

On CUDA, decode steps replay from CUDA graphs (``engine.cuda_graphs``) at the batch sizes
given, on fused Triton kernels where the model allows (``engine.fused_decode``), and so do
speculative verify steps (the model's own forward); every other step, and every step on CPU,
runs eagerly as below. Each device
gets its own layout first: ``engine.weights.optimize_cpu_layout`` on CPU,
``optimize_cuda_layout`` (fewer kernels per layer) on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import PreTrainedModel

from engine.attention import PagedAttentionMetadata, PrefillSegment, VerifyBatch, register_paged_attention
from engine.cuda_graphs import DEFAULT_BATCH_SIZES, BaseGraph, DecodeGraphs, StaticDecode
from engine.decode_kernels import DecodeKernels, triton_available
from engine.fused_decode import FusedDecode, unsupported
from engine.kv_pool import KVPool
from engine.overlap import FedTokens
from engine.params import TokenLogprobs
from engine.sampling import rows_logprobs
from engine.scheduler import ScheduledChunk
from engine.weights import optimize_cpu_layout, optimize_cuda_layout, packed_bytes

logger = logging.getLogger(__name__)

# called after each decoder layer's forward: (layer index, the step's chunks in plan order)
LayerHook = Callable[[int, Sequence[ScheduledChunk]], None]
SCORE_BYTES = 64 << 20  # float32 logits of the prompt rows scored at once (their log-softmax as much again)


@dataclass
class PromptScores:
    """One chunk's prompt rows to score (``prompt_logprobs``): rows ``first_row ..`` of the chunk,
    each for the token after its own, ``targets``; ``execute`` appends each row's log-probabilities
    (of the raw model distribution, with the ``num_top`` most likely) to ``found``."""

    first_row: int
    targets: tuple[int, ...]
    num_top: int
    found: list[TokenLogprobs] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        pool: KVPool,
        packed_weights: bool = False,
        cuda_graph_batch_sizes: Sequence[int] | None = DEFAULT_BATCH_SIZES,
        logits: bool = True,
        decode_kernels: bool = True,
        verify_queries: int = 1,
    ) -> None:
        """``cuda_graph_batch_sizes``: on CUDA, decode steps replay from graphs captured at these
        batch sizes (None or empty: always eager); ignored on CPU. ``decode_kernels``: those
        graphs run the fused Triton kernels where the model allows (False: the model's own
        forward). ``logits``: False on a tensor-parallel rank other than 0, which runs no LM
        head (``execute`` returns None). ``verify_queries``: the most queries a speculative verify
        row has (``num_speculative_tokens`` + 1; 1: no speculation), what verify graphs hold."""
        self.model = model
        self.pool = pool
        self.verify_queries = verify_queries
        self.device = pool.tensor.device
        self.block_size = pool.layout.block_size
        model.set_attn_implementation(register_paged_attention())
        if self.device.type == "cpu":
            optimize_cpu_layout(model, packed_weights)
            if packed_weights:
                logger.info(
                    "kept oneDNN-packed weight copies for batched CPU products: %.0f MB "
                    "(engine.cpu_packed_weights=false to skip)",
                    packed_bytes(model) / 2**20,
                )
        elif self.device.type == "cuda":
            optimize_cuda_layout(model)
        self._decoder = getattr(model, model.base_model_prefix)
        # query heads per KV head (``engine.tensor_parallel`` sets it on a rank's shard)
        self._group = self._decoder.layers[0].self_attn.num_key_value_groups
        self._lm_head = model.get_output_embeddings() if logits else None
        self._layer_hooks: list[LayerHook] = []
        self._chunks: Sequence[ScheduledChunk] = ()  # the step being executed, for the layer hooks
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self.graphs: DecodeGraphs | None = None
        self.fused_decode: FusedDecode | None = None
        if self.device.type == "cuda":
            kernels = self.triton_decode_kernels() if decode_kernels else None
            self.use_cuda_graphs(cuda_graph_batch_sizes, kernels=kernels)

    def triton_decode_kernels(self) -> DecodeKernels | None:
        """The fused Triton kernels, or None (and why, logged) when they cannot run this model."""
        reason = unsupported(self._decoder) if self._lm_head is not None else "no LM head on this rank"
        reason = reason or (None if triton_available() else "Triton is not installed")
        if reason is not None:
            logger.info("decode graphs run the model's own forward, not the fused kernels: %s", reason)
            return None
        return DecodeKernels(triton=True)

    def use_cuda_graphs(
        self,
        batch_sizes: Sequence[int] | None,
        graph_type: Callable[[object], BaseGraph] | None = None,
        kernels: DecodeKernels | None = None,
    ) -> None:
        """Replay decode and verify steps from graphs at ``batch_sizes`` from now on (None or empty: eager).
        ``graph_type``: see ``DecodeGraphs`` (tests replay on CPU with a fake). ``kernels``: the
        graphs' steps run ``engine.fused_decode`` on them (None: the model's own forward)."""
        self.graphs = None
        self.fused_decode = None
        if batch_sizes:
            forward = self._graph_forward
            if kernels is not None:
                forward = self.fused_decode = FusedDecode(self._decoder, self._lm_head, self.pool, kernels)
            self.graphs = DecodeGraphs(
                forward, self.device, self.block_size, self.pool.num_blocks, batch_sizes, graph_type,
                verify_forward=self._graph_forward, max_queries=self.verify_queries,
            )  # fmt: skip

    def add_layer_hook(self, hook: LayerHook) -> None:
        """Call ``hook(layer_idx, chunks)`` after each decoder layer's forward (its K/V is in the
        pool); ``chunks`` is the step's plan as given to ``execute``.

        Forward hooks are attached only while a layer hook exists, so the plain decode
        path carries no hook overhead. A decode step replayed from a CUDA graph runs no Python
        per layer, so it calls no hook; a step that computes prompt tokens (a chunk
        ``in_prompt``, what a layer-pipelined push writes) always runs eagerly and calls them.
        """
        if not self._hook_handles:
            for idx, layer in enumerate(self._decoder.layers):
                self._hook_handles.append(layer.register_forward_hook(partial(self._after_layer, idx)))
        self._layer_hooks.append(hook)

    def remove_layer_hook(self, hook: LayerHook) -> None:
        self._layer_hooks.remove(hook)
        if not self._layer_hooks:
            for handle in self._hook_handles:
                handle.remove()
            self._hook_handles.clear()

    def _after_layer(self, idx: int, module: torch.nn.Module, args: object, output: object) -> None:
        if not self._chunks:  # a CUDA graph's warm-up or capture: no step of the plan runs
            return
        for hook in self._layer_hooks:
            hook(idx, self._chunks)

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        fed: FedTokens | None = None,
        scores: Mapping[str, PromptScores] | None = None,
    ) -> torch.Tensor | None:
        """Run one step; returns float32 logits ``[sum of num_sampled, vocab]``: each sampled
        chunk's rows (``ScheduledChunk.num_sampled``) in ``chunks`` order. ``fed``: every chunk
        is one decode token, taken on the device from the step before (``engine.overlap``).
        ``scores``: by request id, prompt rows whose log-probabilities to fill in (an eager step).

        In an eager step every index tensor is built from Python lists and copied to the
        device before the forward is queued: on CUDA each such copy waits for the stream (a
        graph-replayed step's inputs are queued behind it instead)."""
        if self.graphs is not None and not scores and not (self._layer_hooks and any(c.in_prompt for c in chunks)):
            logits = self.graphs.run(chunks, fed)
            if logits is not None:
                return logits
        order = sorted(range(len(chunks)), key=lambda i: _row_kind(chunks[i]))
        ordered = [chunks[i] for i in order]
        meta, input_ids, positions, first_row = self._build(ordered)
        if fed is not None:  # all decode: one packed row per chunk, in ``order``
            input_ids = fed.gather(torch.tensor([fed.rows[i] for i in order], device=self.device))
        sampled_rows = {order[i]: first_row[i] for i in range(len(ordered))}
        # each sampled chunk's rows in ``chunks`` order: its last token's, then one per proposal
        rows = [r for i, c in enumerate(chunks) for r in range(sampled_rows[i], sampled_rows[i] + c.num_sampled)]
        index = torch.tensor(rows, device=self.device) if rows else None
        self._chunks = chunks
        try:
            hidden = self._decoder(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                paged_metadata=meta,
            ).last_hidden_state[0]
        finally:
            self._chunks = ()
        if self._lm_head is None:
            return None
        if scores:
            self._score(hidden, ordered, first_row, scores)
        if index is None:
            return hidden.new_empty(0, self._lm_head.out_features, dtype=torch.float32)
        return self._lm_head(hidden.index_select(0, index)).float()

    def _score(
        self,
        hidden: torch.Tensor,
        chunks: list[ScheduledChunk],
        first_row: list[int],
        scores: Mapping[str, PromptScores],
    ) -> None:
        """Fill ``scores`` from the step's hidden states (``chunks`` in packed-row order, as ``first_row``)."""
        for chunk, sampled_row in zip(chunks, first_row):
            wanted = scores.get(chunk.request_id)
            if wanted is None:
                continue
            start = sampled_row - len(chunk.token_ids) + chunk.num_sampled + wanted.first_row  # in the packed row
            rows = max(1, SCORE_BYTES // (4 * self._lm_head.out_features))
            for at in range(0, len(wanted.targets), rows):
                targets = wanted.targets[at : at + rows]
                logits = self._lm_head(hidden[start + at : start + at + len(targets)]).float()
                wanted.found += rows_logprobs(logits, targets, wanted.num_top, ranked=True)

    def _graph_forward(self, static: StaticDecode) -> torch.Tensor:
        """A decode or verify step on a graph's static inputs (captured, then replayed): logits
        of every row (a verify step's: of every query, ``num_queries`` per row)."""
        if static.key.num_queries == 1:
            meta = PagedAttentionMetadata(
                pool=self.pool,
                slot_mapping=static.slots,
                num_decode=static.key.batch,
                decode_blocks=static.block_tables,
                decode_mask=static.decode_mask(),
                prefill_segments=(),
            )
        else:  # every query a verify row's, in order: the indices are the identity
            mask, every = static.verify_mask(self._group), static.queries
            verify = VerifyBatch(static.key.num_queries, every, static.block_tables, mask, None, every)
            meta = PagedAttentionMetadata(self.pool, static.slots, 0, None, None, (), verify)
        hidden = self._decoder(
            input_ids=static.token_ids.unsqueeze(0),
            position_ids=static.positions.unsqueeze(0),
            attention_mask=static.model_mask,
            use_cache=False,
            paged_metadata=meta,
        ).last_hidden_state[0]
        return self._lm_head(hidden).float()

    def _build(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[PagedAttentionMetadata, torch.Tensor, torch.Tensor, list[int]]:
        """Packed inputs of chunks ordered decode, verify, prefill; and each chunk's first
        sampled row in the packed row."""
        decode = [c for c in chunks if c.is_decode]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        first_row: list[int] = []
        segments: list[PrefillSegment] = []
        verify: list[tuple[int, ScheduledChunk]] = []
        for c in chunks:
            n = len(c.token_ids)
            q_start = len(token_ids)
            span = range(c.start_pos, c.start_pos + n)
            token_ids.extend(c.token_ids)
            positions.extend(span)
            slots.extend(_slots(c.block_ids, span, self.block_size))
            first_row.append(q_start + n - c.num_sampled)
            if c.num_draft:
                verify.append((q_start, c))
            elif not c.is_decode:
                segments.append(self._segment(q_start, c))
        # one host-to-device copy for the three per-token rows
        input_ids, position_ids, slot_mapping = torch.tensor([token_ids, positions, slots], device=self.device)
        decode_blocks, decode_mask = self._decode_blocks(decode)
        meta = PagedAttentionMetadata(
            pool=self.pool,
            slot_mapping=slot_mapping,
            num_decode=len(decode),
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            prefill_segments=tuple(segments),
            verify=self._verify_batch(verify) if verify else None,
        )
        return meta, input_ids, position_ids, first_row

    def _segment(self, q_start: int, chunk: ScheduledChunk) -> PrefillSegment:
        n = len(chunk.token_ids)
        if chunk.start_pos == 0:
            return PrefillSegment(q_start, q_start + n)
        context_len = chunk.start_pos + n
        context_slots = torch.tensor(_slots(chunk.block_ids, range(context_len), self.block_size), device=self.device)
        ctx = torch.arange(context_len, device=self.device)
        q_pos = torch.arange(chunk.start_pos, context_len, device=self.device)
        mask = (ctx[None, :] <= q_pos[:, None]).view(1, 1, n, context_len)
        return PrefillSegment(q_start, q_start + n, context_slots, mask)

    def _decode_blocks(self, decode: list[ScheduledChunk]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every decode sequence's block table, padded to the longest with block 0, and the
        attention mask: True at each sequence's own context positions, False past its
        length (None when every sequence fills all of its gathered blocks)."""
        if not decode:
            return None, None
        lengths = [c.start_pos + 1 for c in decode]
        tables, max_blocks = self._tables(decode, lengths)
        if min(lengths) == max_blocks * self.block_size:
            return tables, None
        pos = torch.arange(max_blocks * self.block_size, device=self.device)
        length = torch.tensor(lengths, device=self.device)
        mask = (pos[None, :] < length[:, None]).view(len(decode), 1, 1, max_blocks * self.block_size)
        return tables, mask

    def _tables(self, chunks: Sequence[ScheduledChunk], lengths: list[int]) -> tuple[torch.Tensor, int]:
        """The chunks' block tables cut or padded (block 0) to the blocks of the longest length."""
        max_blocks = -(-max(lengths) // self.block_size)
        rows = [list(c.block_ids[:max_blocks]) + [0] * (max_blocks - min(len(c.block_ids), max_blocks)) for c in chunks]
        return torch.tensor(rows, device=self.device), max_blocks

    def _verify_batch(self, rows: list[tuple[int, ScheduledChunk]]) -> VerifyBatch:
        """Verify rows (``attention.VerifyBatch``) from each row's first token in the packed row."""
        nq = max(len(c.token_ids) for _, c in rows)
        lengths = [c.start_pos + len(c.token_ids) for _, c in rows]
        tables, max_blocks = self._tables([c for _, c in rows], lengths)
        query_index, valid, out_index, limits = [], [], [], []
        for r, (q_start, c) in enumerate(rows):
            n = len(c.token_ids)
            for q in range(nq):
                query_index.append(q_start + min(q, n - 1))
                limits.append(c.start_pos + min(q, n - 1))
                if q < n:
                    valid.append(r * nq + q)
                    out_index.append(q_start + q)
        ctx = torch.arange(max_blocks * self.block_size, device=self.device)
        limit = torch.tensor(limits, device=self.device).view(len(rows), 1, 1, nq, 1)
        mask = (ctx <= limit).expand(-1, -1, self._group, -1, -1).reshape(len(rows), 1, -1, ctx.numel())
        every = len(valid) == len(query_index)
        return VerifyBatch(
            num_queries=nq,
            query_index=torch.tensor(query_index, device=self.device),
            blocks=tables,
            mask=mask,
            valid=None if every else torch.tensor(valid, device=self.device),
            out_index=torch.tensor(out_index, device=self.device),
        )


def _row_kind(chunk: ScheduledChunk) -> int:
    """Packed-row order: decode tokens, verify rows, prefill segments."""
    return 0 if chunk.is_decode else 1 if chunk.num_draft else 2


def _slots(block_ids: Sequence[int], positions: range, block_size: int) -> list[int]:
    """Pool slot of each position: ``block_ids[pos // block_size] * block_size + pos % block_size``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]
