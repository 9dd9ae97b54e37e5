"""Triton kernels of ``engine.decode_kernels`` (launched there; its docstring says what each computes).

Every kernel reads its sizes from the tensors it is given and its per-step values (slots,
lengths, block tables) from device memory, so a CUDA graph captures one launch per kernel
and replays it on new inputs. ``TRITON_INTERPRET=1`` runs them on CPU tensors (slowly).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=keep, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * n + offs, mask=keep, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the sum rounds as the model's add
        tl.store(res_ptr + row * n + offs, x, mask=keep)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=keep, other=0.0)
    tl.store(out_ptr + row * n + offs, (w.to(tl.float32) * normed).to(w.dtype), mask=keep)


@triton.jit
def rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr, q_ptr, q_norm_ptr, k_norm_ptr, eps,
    qkv_stride, rope_stride, num_heads, kv_heads,
    DIM: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr, KV_P: tl.constexpr, DIM_P: tl.constexpr,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """``QK_NORM``: each q and k head RMS-normed over its dimensions first (Qwen3's q_norm and
    k_norm), rounded as those modules round."""
    row = tl.program_id(0)
    half = DIM // 2
    h = tl.arange(0, HEADS_P)[:, None]  # q heads then k heads
    d = tl.arange(0, HALF_P)[None, :]
    keep = (h < num_heads + kv_heads) & (d < half)
    src = qkv_ptr + row * qkv_stride + h * DIM + d
    x1 = tl.load(src, mask=keep, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=keep, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + row * rope_stride + d, mask=d < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * rope_stride + half + d, mask=d < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * rope_stride + d, mask=d < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * rope_stride + half + d, mask=d < half, other=0.0).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    is_q = h < num_heads
    if QK_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / DIM + eps)[:, None]
        w1 = tl.where(
            is_q, tl.load(q_norm_ptr + d, mask=d < half, other=0.0), tl.load(k_norm_ptr + d, mask=d < half, other=0.0)
        )
        w2 = tl.where(is_q, tl.load(q_norm_ptr + half + d, mask=d < half, other=0.0),
                      tl.load(k_norm_ptr + half + d, mask=d < half, other=0.0))  # fmt: skip
        x1 = (w1.to(tl.float32) * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2.to(tl.float32) * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1 * c1 - x2 * s1).to(dtype)  # rotate_half(x) = (-x2, x1)
    o2 = (x2 * c2 + x1 * s2).to(dtype)
    q_dst = q_ptr + (row * num_heads + h) * DIM + d
    tl.store(q_dst, o1, mask=keep & is_q)
    tl.store(q_dst + half, o2, mask=keep & is_q)
    slot = tl.load(slots_ptr + row)
    k_dst = k_ptr + (slot * kv_heads + (h - num_heads)) * DIM + d
    tl.store(k_dst, o1, mask=keep & (h >= num_heads))
    tl.store(k_dst + half, o2, mask=keep & (h >= num_heads))
    vh = tl.arange(0, KV_P)[:, None]
    vd = tl.arange(0, DIM_P)[None, :]
    v_keep = (vh < kv_heads) & (vd < DIM)
    v = tl.load(qkv_ptr + row * qkv_stride + (num_heads + kv_heads + vh) * DIM + vd, mask=v_keep, other=0.0)
    tl.store(v_ptr + (slot * kv_heads + vh) * DIM + vd, v, mask=v_keep)


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr, best_ptr, total_ptr, scale,
    tables_stride, num_heads, kv_heads, num_parts,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr, PART: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, KV head, part of the context): its group of query heads
    (padded to a product's 16 rows) over the part's tokens, TILE at a time through the block
    table, with an online softmax. ``SPLIT``: the part's unnormalized output, running max and
    sum go to float32 buffers for ``merge_parts_kernel``; else the output itself."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM_P)
    t = tl.arange(0, TILE)
    q_keep = (g[:, None] < GROUP) & (d[None, :] < DIM)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + (row * num_heads + heads[:, None]) * DIM + d[None, :], mask=q_keep, other=0.0)
    length = tl.load(lengths_ptr + row)
    end = tl.minimum(length, (part + 1) * PART) if SPLIT else length
    best = tl.full((GROUP_P,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_P,), tl.float32)
    acc = tl.zeros((GROUP_P, DIM_P), tl.float32)
    for start in range(part * PART, end, TILE):
        pos = start + t
        valid = pos < end
        block = tl.load(tables_ptr + row * tables_stride + pos // BLOCK, mask=valid, other=0)
        offset = ((block * BLOCK + pos % BLOCK)[:, None] * kv_heads + kvh) * DIM + d[None, :]
        kv_keep = valid[:, None] & (d[None, :] < DIM)
        k = tl.load(k_ptr + offset, mask=kv_keep, other=0.0)  # [TILE, DIM_P]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_P, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp(scores - new_best[:, None])
        alpha = tl.exp(best - new_best)
        v = tl.load(v_ptr + offset, mask=kv_keep, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        total = total * alpha + tl.sum(p, axis=1)
        best = new_best
    slot = (row * num_heads + heads) * num_parts + part  # [GROUP_P]: this part of each head
    if SPLIT:
        tl.store(out_ptr + slot[:, None] * DIM + d[None, :], acc, mask=q_keep)
        tl.store(best_ptr + slot, best, mask=g < GROUP)
        tl.store(total_ptr + slot, total, mask=g < GROUP)
    else:
        out = acc / total[:, None]
        tl.store(out_ptr + (row * num_heads + heads[:, None]) * DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=q_keep)  # fmt: skip


@triton.jit
def merge_parts_kernel(
    acc_ptr, best_ptr, total_ptr, out_ptr, num_parts, DIM: tl.constexpr, DIM_P: tl.constexpr, PARTS_P: tl.constexpr
):
    """One program per (sequence, query head): its parts' outputs rescaled to the overall max
    and summed (a part past the sequence's length has max -inf and adds nothing)."""
    head = tl.program_id(0)  # row * num_heads + head
    parts = tl.arange(0, PARTS_P)
    d = tl.arange(0, DIM_P)
    keep = parts < num_parts
    best = tl.load(best_ptr + head * num_parts + parts, mask=keep, other=float("-inf"))
    overall = tl.max(best, axis=0)
    weight = tl.where(keep & (best > float("-inf")), tl.exp(best - overall), 0.0)
    total = tl.sum(tl.load(total_ptr + head * num_parts + parts, mask=keep, other=0.0) * weight, axis=0)
    acc_keep = keep[:, None] & (d[None, :] < DIM)
    acc = tl.load(acc_ptr + (head * num_parts + parts[:, None]) * DIM + d[None, :], mask=acc_keep, other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + head * DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < DIM)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    gate = tl.load(gu_ptr + row * 2 * width + cols, mask=keep, other=0.0)
    up = tl.load(gu_ptr + row * 2 * width + width + cols, mask=keep, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # silu rounds as the model's act_fn
    tl.store(out_ptr + row * width + cols, (act * up).to(gate.dtype), mask=keep)
