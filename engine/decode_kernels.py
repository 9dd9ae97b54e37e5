"""The four fused kernels of a decode step on a GPU (Triton), and the same arithmetic in torch.

A decode step replayed from a CUDA graph costs what its kernels cost, and most of an
unfused layer's ~38 kernels are small elementwise ones (norms, rotary embedding, K/V writes
and block gathers, SiLU, residual adds: docs/benchmarks/gpu.md). These four replace them, so
a layer runs its four products and four kernels (``engine.fused_decode``):

* ``add_rms_norm``: the residual add and the next RMSNorm, one pass over the row;
* ``rope_write_kv``: rotary embedding of the new token's q and k (Qwen3's per-head q and k
  RMSNorms first), k and v written into the paged pool at the token's slot, q written out
  contiguous;
* ``paged_decode_attention``: each sequence's query heads over its context, read from the
  pool's blocks in place through the block table (no gathered copy, no mask tensor); a long
  context is split into parts attended in parallel, then merged;
* ``silu_mul``: ``silu(gate) * up``.

Each rounds where transformers' own modules round (the residual sum, the normalized row
and the SiLU output in the model's dtype), so the fused step differs from the unfused one
only in the order of float32 sums. ``DecodeKernels(triton=False)`` computes the same in torch
ops: the reference the Triton kernels are tested against (tests/gpu), and what runs the fused
step's structure on a machine without Triton (tests/engine). The kernels themselves:
``engine._triton_decode``.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.attention import gather_blocks
from engine.weights import rms_norm

PART = 256  # context tokens per attention program when a context is split


def triton_available() -> bool:
    """Triton is importable (it comes with PyTorch's CUDA builds on Linux)."""
    return importlib.util.find_spec("triton") is not None


class QKNorm(NamedTuple):
    """Qwen3's per-head RMSNorms of q and k: their weights ``[D]`` and epsilon."""

    q: torch.Tensor
    k: torch.Tensor
    eps: float


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


class DecodeKernels:
    """The four kernels: ``triton`` launches Triton's (compiled on first use, CUDA tensors; CPU
    tensors under ``TRITON_INTERPRET=1``), else the same arithmetic runs as torch ops."""

    def __init__(self, triton: bool) -> None:
        self._k = None
        if triton:
            from engine import _triton_decode  # Triton is imported only where it is used

            self._k = _triton_decode

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place (when given), then RMSNorm of the sum (of ``x`` without
        one) times ``weight``; ``[rows, hidden]``."""
        if self._k is None:
            if residual is not None:
                residual.add_(x)
                x = residual
            return rms_norm(x, weight, eps)
        rows, n = x.shape
        out = torch.empty_like(x, dtype=weight.dtype)
        res = x if residual is None else residual
        self._k.add_rms_norm_kernel[(rows,)](x, res, weight, out, n, eps, HAS_RES=residual is not None, BLOCK=_pow2(n))
        return out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        num_heads: int,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """``qkv`` ``[rows, (H + 2 KVH) * D]`` (q heads, k heads, v heads); ``cos``/``sin``
        ``[rows, D]``; writes rotated k and v at ``slots`` of ``k_slots``/``v_slots``
        ``[num_slots, KVH, D]``; returns rotated q ``[rows, H, D]``. ``qk_norm``: each q and k
        head RMS-normed first (Qwen3)."""
        rows = qkv.shape[0]
        kv_heads, dim = k_slots.shape[1:]
        if self._k is None:
            heads = qkv.view(rows, num_heads + 2 * kv_heads, dim)
            qk = heads[:, : num_heads + kv_heads]
            if qk_norm is not None:
                weights = torch.cat((qk_norm.q.expand(num_heads, dim), qk_norm.k.expand(kv_heads, dim)))
                qk = rms_norm(qk, weights, qk_norm.eps)
            qk = qk.float()
            rotated = torch.cat((-qk[..., dim // 2 :], qk[..., : dim // 2]), dim=-1)
            qk = (qk * cos[:, None].float() + rotated * sin[:, None].float()).to(qkv.dtype)
            k_slots.index_copy_(0, slots, qk[:, num_heads:])
            v_slots.index_copy_(0, slots, heads[:, num_heads + kv_heads :])
            return qk[:, :num_heads].contiguous()
        q = torch.empty(rows, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
        norm = qk_norm or QKNorm(q, q, 0.0)  # the kernel reads no weight without QK_NORM
        self._k.rope_write_kv_kernel[(rows,)](
            qkv, cos, sin, slots, k_slots, v_slots, q, norm.q, norm.k, norm.eps,
            qkv.stride(0), cos.stride(0), num_heads, kv_heads, DIM=dim,
            HALF_P=_pow2(dim // 2), HEADS_P=_pow2(num_heads + kv_heads), KV_P=_pow2(kv_heads), DIM_P=_pow2(dim),
            QK_NORM=qk_norm is not None,
        )  # fmt: skip
        return q

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``q`` ``[rows, H, D]``; ``k_blocks``/``v_blocks`` ``[num_blocks, block_size, KVH, D]``;
        row r attends over its first ``lengths[r]`` positions through ``block_tables[r]``."""
        rows, num_heads, dim = q.shape
        block_size, kv_heads = k_blocks.shape[1:3]
        context = block_tables.shape[1] * block_size
        if self._k is None:
            k, v = gather_blocks(k_blocks, v_blocks, block_tables)
            grouped = q.view(rows, kv_heads, num_heads // kv_heads, dim)
            mask = (torch.arange(context, device=q.device)[None, :] < lengths[:, None]).view(rows, 1, 1, context)
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
            return out.reshape(rows, num_heads, dim)
        # a context longer than PART tokens (by the table's width) is split into parts: a batch-1
        # step would otherwise run one program per KV head over the whole context
        parts = -(-context // PART)
        out = torch.empty_like(q)
        acc, best, total = out, out, out  # unused by the kernel unless split
        if parts > 1:
            acc = torch.empty(rows, num_heads, parts, dim, dtype=torch.float32, device=q.device)
            best, total = (torch.empty(rows, num_heads, parts, dtype=torch.float32, device=q.device) for _ in range(2))
        group = num_heads // kv_heads
        self._k.paged_decode_kernel[(rows, kv_heads, parts)](
            q, k_blocks, v_blocks, block_tables, lengths, acc, best, total, scale,
            block_tables.stride(0), num_heads, kv_heads, parts,
            GROUP=group, GROUP_P=_pow2(group, 16), DIM=dim, DIM_P=_pow2(dim, 16), BLOCK=block_size,
            TILE=max(16, min(64, _pow2(block_size) * 4)), PART=PART, SPLIT=parts > 1,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )  # fmt: skip
        if parts > 1:
            self._k.merge_parts_kernel[(rows * num_heads,)](acc, best, total, out, parts, DIM=dim, DIM_P=_pow2(dim),
                                                            PARTS_P=_pow2(parts, 2))  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up`` ``[rows, 2 I]`` (gate columns, then up) -> ``silu(gate) * up`` ``[rows, I]``."""
        if self._k is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        self._k.silu_mul_kernel[(rows, -(-width // 1024))](gate_up, out, width, BLOCK=1024)
        return out
