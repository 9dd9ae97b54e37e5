"""Paged attention registered through transformers' ``AttentionInterface``.

The model's own attention modules compute q/k/v and RoPE; this function then
  1. writes the step's new K/V into the pool at ``slot_mapping`` (slot = block * block_size
     + offset), and
  2. attends each sequence's queries over its own context, read back through its block
     table.

Token layout of one step (one packed row, no padding)::

    [ d0 d1 ... d(n-1) | v0 v0 v0 | v1 v1 | ... | p0 p0 p0 p0 | p1 p1 | ... ]
      decode tokens,     verify rows: a last      prefill segments (whole prompts or chunks)
      one per sequence   token + its proposals

Decode tokens run as one batched SDPA over their block tables: each sequence's blocks
are gathered whole (``[num_decode, max_blocks]`` rows of ``block_size`` tokens, masked past
each sequence's length), and the query heads that share a KV head attend as one group of
queries (``[num_decode, kv_heads, heads // kv_heads, head_dim]``), so K/V are neither
gathered per token nor repeated per query head: fewer, larger copies make a batched decode
step cheaper (the figures: ``docs/benchmarks/cpu_kernels.md``). A prefill segment whose whole
context is in this step (a fresh prompt) attends causally over its own new K/V; a chunk that
continues a prompt gathers its earlier context from the pool with an offset causal mask.
Verify rows (speculative decoding: a few queries per sequence) run as one batched SDPA like
decode, each row's queries padded to the longest and masked causally (``VerifyBatch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from engine.kv_pool import KVPool

PAGED_ATTENTION = "tandem_paged"


@dataclass(frozen=True)
class PrefillSegment:
    """Queries ``[q_start, q_end)`` of the packed row; ``context_slots`` is None for a fresh prompt."""

    q_start: int
    q_end: int
    context_slots: torch.Tensor | None = None  # [context_len] slots incl. this chunk
    mask: torch.Tensor | None = None  # [1, 1, q_len, context_len] bool


@dataclass(frozen=True)
class VerifyBatch:
    """Verify rows: ``num_rows`` sequences of at most ``num_queries`` queries each.

    ``query_index`` ``[num_rows * num_queries]``: each padded query's token in the packed row
    (a short row repeats its last); ``mask`` ``[num_rows, 1, group * num_queries, context]``:
    query ``(g, q)`` of a row sees the context up to its own position; ``valid`` (None: all are)
    picks the real queries of the padded ``[num_rows * num_queries]``, written to ``out_index``."""

    num_queries: int
    query_index: torch.Tensor
    blocks: torch.Tensor  # [num_rows, max_blocks], padded with block 0
    mask: torch.Tensor
    valid: torch.Tensor | None
    out_index: torch.Tensor


@dataclass(frozen=True)
class PagedAttentionMetadata:
    pool: KVPool
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decode: int
    decode_blocks: torch.Tensor | None  # [num_decode, max_blocks] block ids, padded with block 0
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool, None if all full
    prefill_segments: tuple[PrefillSegment, ...]
    verify: VerifyBatch | None = None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query ``[1, H, T, D]``, key/value ``[1, KVH, T, D]`` -> output ``[1, T, H, D]``."""
    meta = paged_metadata
    if meta is None:
        raise RuntimeError("paged attention called without paged_metadata (use engine.model_runner)")
    layer = module.layer_idx
    k_slots = meta.pool.key_slots(layer)
    v_slots = meta.pool.value_slots(layer)
    k_slots.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_slots.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    num_tokens = query.shape[2]
    out = query.new_empty(num_tokens, query.shape[1], query.shape[3])
    nd = meta.num_decode
    if nd:
        num_heads, (num_kv_heads, head_dim) = query.shape[1], k_slots.shape[1:]
        # query heads grouped by the KV head they read: head h reads KV head h // group
        q = query[0, :, :nd].transpose(0, 1).reshape(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        k, v = gather_blocks(meta.pool.key_blocks(layer), meta.pool.value_blocks(layer), meta.decode_blocks)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling)  # [nd, KVH, G, D]
        out[:nd] = o.reshape(nd, num_heads, head_dim)
    if meta.verify is not None:
        _verify_attention(query, meta.pool, layer, meta.verify, out, scaling)
    for seg in meta.prefill_segments:
        q = query[:, :, seg.q_start : seg.q_end]
        if seg.context_slots is None:
            k = key[:, :, seg.q_start : seg.q_end]
            v = value[:, :, seg.q_start : seg.q_end]
        else:
            k = k_slots.index_select(0, seg.context_slots).transpose(0, 1).unsqueeze(0)
            v = v_slots.index_select(0, seg.context_slots).transpose(0, 1).unsqueeze(0)
        o, _ = sdpa_attention_forward(module, q, k, v, seg.mask, scaling=scaling)
        out[seg.q_start : seg.q_end] = o[0]
    return out.unsqueeze(0), None


def gather_blocks(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[rows, KVH, blocks * block_size, D]`` of each row's block table, from a layer's
    ``[num_blocks, block_size, KVH, D]`` blocks: an ``index_select`` of whole blocks, one
    contiguous block_size-token run each."""
    rows, ctx = tables.shape[0], tables.shape[1] * k_blocks.shape[1]
    blocks = tables.view(-1)
    k = k_blocks.index_select(0, blocks)
    v = v_blocks.index_select(0, blocks)
    shape = (rows, ctx, *k.shape[-2:])
    return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)


def _verify_attention(
    query: torch.Tensor, pool: KVPool, layer: int, verify: VerifyBatch, out: torch.Tensor, scaling: float | None
) -> None:
    """Verify rows as one SDPA: queries ``[rows, KVH, G * Q, D]`` (grouped by KV head as decode)."""
    num_heads, head_dim = query.shape[1], query.shape[3]
    rows, nq = verify.blocks.shape[0], verify.num_queries
    k, v = gather_blocks(pool.key_blocks(layer), pool.value_blocks(layer), verify.blocks)
    num_kv_heads, group = k.shape[1], num_heads // k.shape[1]
    q = query[0].transpose(0, 1).index_select(0, verify.query_index)  # [rows * Q, H, D]
    q = q.view(rows, nq, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(rows, num_kv_heads, -1, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=verify.mask, scale=scaling)  # [rows, KVH, G * Q, D]
    o = o.view(rows, num_kv_heads, group, nq, head_dim).permute(0, 3, 1, 2, 4).reshape(rows * nq, num_heads, head_dim)
    out.index_copy_(0, verify.out_index, o if verify.valid is None else o.index_select(0, verify.valid))


def _no_mask(*args: object, **kwargs: object) -> None:
    """The model must not build a dense mask: paged attention masks per sequence itself."""
    return None


def register_paged_attention() -> str:
    """Register the function and its (empty) mask builder; returns the implementation name."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)
    return PAGED_ATTENTION
