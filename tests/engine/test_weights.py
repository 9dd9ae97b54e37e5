"""Fused projections and the CPU weight layout give the model's own outputs."""

from __future__ import annotations

import pytest
import torch

from engine.fused_linear import FusedLinear, FusedSlice
from engine.weights import optimize_cpu_layout
from tests.engine.conftest import tiny_loaded


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_fused_layout_keeps_every_projection_and_the_logits(family: str) -> None:
    ours, reference = tiny_loaded(family)
    ref_attn = reference.model.model.layers[1].self_attn
    ref_mlp = reference.model.model.layers[1].mlp
    changed = optimize_cpu_layout(ours.model)
    # 3 layers x (q/k/v, gate/up) fused; o_proj and the LM head (out >= in) re-laid out
    assert changed == 3 * 2 + 3 + 1
    assert optimize_cpu_layout(ours.model) == 3 + 1  # again: nothing fused twice, o_proj and lm_head as they are
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
