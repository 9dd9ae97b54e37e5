"""The Triton kernels of a fused decode step (``engine._triton_decode``) against the same
arithmetic in torch ops (``engine.decode_kernels.DecodeKernels(triton=False)``) on the GPU, in float32
and bfloat16, at the 8B-class shapes, a tiny one and one with sizes that are no power of two;
contexts split into parts and not. The whole step against the eager engine and transformers:
test_cuda_graphs.py and test_cuda_engine.py."""

from __future__ import annotations

import pytest
import torch

from engine.decode_kernels import DecodeKernels, QKNorm, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs Triton")
TRITON = DecodeKernels(triton=True) if triton_available() else None

# (query heads, KV heads, head dim, block size)
SHAPES = [(32, 8, 128, 16), (4, 2, 16, 8), (6, 2, 80, 4)]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPE_IDS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REF = DecodeKernels(triton=False)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPE_IDS.values(), ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 3000])
def test_add_rms_norm_and_silu_mul(cuda, dtype, hidden):
    gen = torch.Generator(device=cuda).manual_seed(hidden)
    x, residual = (torch.randn(5, hidden, generator=gen, device=cuda, dtype=dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=gen, device=cuda, dtype=dtype)
    want_residual, got_residual = residual.clone(), residual.clone()
    want = REF.add_rms_norm(x, want_residual, weight, 1e-5)
    _close(TRITON.add_rms_norm(x, got_residual, weight, 1e-5), want, dtype)
    assert torch.equal(got_residual, want_residual)  # the sum rounds once, in both
    _close(TRITON.add_rms_norm(x, None, weight, 1e-5), REF.add_rms_norm(x, None, weight, 1e-5), dtype)
    gate_up = torch.randn(5, 2 * hidden, generator=gen, device=cuda, dtype=dtype)
    _close(TRITON.silu_mul(gate_up), REF.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", DTYPE_IDS.values(), ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
def test_rope_write_kv_writes_only_the_rows_slots(cuda, dtype, heads, kv_heads, dim, block_size, qk_norm):
    gen = torch.Generator(device=cuda).manual_seed(dim)
    rows, num_slots = 6, 64 * block_size
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen, device=cuda, dtype=dtype)
    cos, sin = (torch.randn(rows, dim, generator=gen, device=cuda, dtype=dtype) for _ in range(2))
    slots = torch.tensor([3, 17, num_slots - 1, 40, 41, 3], device=cuda)  # the last row repeats the first (padding)
    qkv[5] = qkv[0]
    cos[5], sin[5] = cos[0], sin[0]
    pools = [torch.zeros(num_slots, kv_heads, dim, device=cuda, dtype=dtype) for _ in range(4)]
    norm = None
    if qk_norm:  # Qwen3's per-head norms of q and k, each its own weights
        norm = QKNorm(*(torch.randn(dim, generator=gen, device=cuda, dtype=dtype) for _ in range(2)), 1e-6)
    want_q = REF.rope_write_kv(qkv, cos, sin, slots, pools[0], pools[1], heads, norm)
    got_q = TRITON.rope_write_kv(qkv, cos, sin, slots, pools[2], pools[3], heads, norm)
    _close(got_q, want_q, dtype)
    _close(pools[2], pools[0], dtype)
    assert torch.equal(pools[3], pools[1])  # v is copied, not computed
    untouched = torch.ones(num_slots, dtype=torch.bool, device=cuda)
    untouched[slots] = False
    assert not pools[2][untouched].any() and not pools[3][untouched].any()


@pytest.mark.parametrize("dtype", DTYPE_IDS.values(), ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
def test_paged_decode_attention_reads_each_rows_own_blocks(cuda, dtype, heads, kv_heads, dim, block_size):
    gen = torch.Generator(device=cuda).manual_seed(heads + dim)
    num_blocks, rows, table_len = 192, 4, 40
    k_blocks, v_blocks = (
        torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, device=cuda, dtype=dtype) for _ in range(2)
    )
    # shuffled, no block in two rows
    tables = torch.randperm(num_blocks, generator=gen, device=cuda)[: rows * table_len].view(rows, table_len)
    # one token, a block and one more, a long context, the whole table
    lengths = torch.tensor([1, block_size + 1, 37 * block_size - 3, table_len * block_size], device=cuda)
    q = torch.randn(rows, heads, dim, generator=gen, device=cuda, dtype=dtype)
    want = REF.paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, dim**-0.5)
    got = TRITON.paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, dim**-0.5)
    _close(got, want, dtype)
    # a position past a row's length changes nothing
    k_blocks[tables[1, 1], 1:] = 1e4
    _close(TRITON.paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, dim**-0.5), got, dtype)
