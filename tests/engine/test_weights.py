"""Fused projections and the CPU weight layout give the model's own outputs."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_matmul
from engine.fused_linear import FusedLinear, FusedSlice
from engine.weights import optimize_cpu_layout, packed_bytes
from tests.engine.conftest import tiny_loaded


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_fused_layout_keeps_every_projection_and_the_logits(family: str) -> None:
    ours, reference = tiny_loaded(family)
    ref_attn = reference.model.model.layers[1].self_attn
    ref_mlp = reference.model.model.layers[1].mlp
    changed = optimize_cpu_layout(ours.model)
    # 3 layers x (q/k/v, gate/up) fused; o_proj, down_proj and the LM head get the CPU product
    # (o_proj and the LM head, out >= in, re-laid out column-major)
    assert changed == 3 * 2 + 3 + 3 + 1
    assert optimize_cpu_layout(ours.model) == 3 + 3 + 1  # again: nothing fused twice, the rest as they are
    attn, mlp = ours.model.model.layers[1].self_attn, ours.model.model.layers[1].mlp
    assert isinstance(attn.q_proj, FusedLinear) and isinstance(attn.v_proj, FusedSlice)
    assert isinstance(mlp.gate_proj, FusedLinear) and isinstance(mlp.up_proj, FusedSlice)
    assert attn.k_proj.weight_t.data_ptr() != attn.q_proj.weight_t.data_ptr()  # a view into the fused weight
    assert attn.k_proj.weight_t.untyped_storage().data_ptr() == attn.q_proj.weight_t.untyped_storage().data_ptr()

    torch.manual_seed(1)
    x, other = torch.randn(5, 64), torch.randn(5, 64)
    with torch.inference_mode():
        # the group's order (q then k then v) takes the shared product ...
        for fused, ref in (
            (attn.q_proj, ref_attn.q_proj),
            (attn.k_proj, ref_attn.k_proj),
            (attn.v_proj, ref_attn.v_proj),
        ):
            torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-5)
        # ... and a slice called on another input computes its own
        torch.testing.assert_close(attn.v_proj(other), ref_attn.v_proj(other), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp(x), ref_mlp(x), rtol=1e-5, atol=1e-5)
        ids = torch.tensor([[3, 17, 99, 250, 7, 42]])
        torch.testing.assert_close(ours.model(ids).logits, reference.model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 40])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_product_matches_linear_for_every_row_count(
    rows: int, column_major: bool, with_bias: bool, packed: bool
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(48, 32)
    if column_major:
        weight = weight.t().contiguous().t()  # [out, in] view of a contiguous [in, out] tensor
    bias = torch.randn(48) if with_bias else None
    x = torch.randn(1, rows, 32)  # the decoder's [batch, tokens, hidden]
    with torch.inference_mode():
        out = cpu_matmul.linear(x, weight, weight.t(), bias, cpu_matmul.pack(weight) if packed else None)
        expected = torch.nn.functional.linear(x, weight, bias)
    assert out.shape == (1, rows, 48)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_onednn_takes_products_of_two_rows_or_more_here() -> None:
    """The x86 CPU build of PyTorch this project installs has oneDNN: the fast path is live."""
    assert torch.backends.mkldnn.is_available() and cpu_matmul._ONEDNN_LINEAR is not None
    assert cpu_matmul.pack(torch.randn(8, 4)) is not None


def test_packed_copies_serve_batched_rows_and_leave_one_row_alone() -> None:
    ours, reference = tiny_loaded("qwen2")  # q/k/v with biases
    optimize_cpu_layout(ours.model, packed_weights=True)
    attn = ours.model.model.layers[0].self_attn
    head = ours.model.get_output_embeddings()
    assert attn.q_proj.packed_weight is not None and head.packed_weight is not None
    assert ours.model.model.layers[0].mlp.down_proj.packed_weight is not None
    # one packed copy of every product's weight: the bytes of all linear weights once more
    linear_bytes = sum(m.weight.numel() * 4 for m in reference.model.modules() if isinstance(m, torch.nn.Linear))
    assert packed_bytes(ours.model) == linear_bytes
    with torch.inference_mode():
        for ids in ([[5]], [[3, 17, 99, 250, 7, 42]]):  # one row (MKL), several rows (packed oneDNN)
            ids = torch.tensor(ids)
            torch.testing.assert_close(ours.model(ids).logits, reference.model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_products_stay_on_torch_matmul(dtype: torch.dtype) -> None:
    """oneDNN's bf16/fp16 paths need CPU features PyTorch checks itself: not packed, not called."""
    weight = torch.randn(48, 32, dtype=dtype).t().contiguous().t()
    assert cpu_matmul.pack(weight) is None
    x = torch.randn(1, 5, 32, dtype=dtype)
    with torch.inference_mode():
        out = cpu_matmul.linear(x, weight, weight.t(), None)
    torch.testing.assert_close(out, x @ weight.t())
    ours, reference = tiny_loaded("llama")
    ours.model.to(dtype)
    reference.model.to(dtype)
    optimize_cpu_layout(ours.model, packed_weights=True)
    assert packed_bytes(ours.model) == 0
    with torch.inference_mode():
        ids = torch.tensor([[3, 17, 99, 250, 7, 42]])
        torch.testing.assert_close(ours.model(ids).logits, reference.model(ids).logits, rtol=2e-2, atol=2e-2)
