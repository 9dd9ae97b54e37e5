"""A graph-replayed decode step of a Llama, Qwen2, Qwen3 or Mistral model as four products and
four fused kernels per layer.

The model's own forward launches about 38 kernels per layer on a GPU, most of them small
elementwise ones, and they cost a decode step more than its products (docs/benchmarks/gpu.md).
This forward walks the same modules' weights with ``engine.decode_kernels`` instead::

    x = norm(embed)                                       # the first layer's input norm
    per layer:  qkv = x @ W_qkv                           # fused q/k/v product
                q = rope_write_kv(qkv)                    # (Qwen3: q/k norms) k, v into the pool
                o = paged_decode_attention(q)             # through the block table, in place
                x = add_rms_norm(o @ W_o, residual)       # residual += ..., post-attention norm
                x = add_rms_norm(silu_mul(x @ W_gu) @ W_down, residual)  # the next layer's norm
    logits = lm_head(x)                                   # x: normed by the final norm

It reads the static inputs of a ``engine.cuda_graphs.StaticDecode`` (one token per row, row
padding as there), so it serves only pure decode steps replayed from graphs; every other step
runs the model's own forward with paged attention. The arithmetic is the model's, rounded
where its modules round (``engine.decode_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.cuda_graphs import StaticDecode
from engine.decode_kernels import DecodeKernels, QKNorm
from engine.fused_linear import FusedLinear
from engine.kv_pool import KVPool
from engine.weights import RMS_NORMS

# decoder layers whose forward this one reproduces: pre-norm attention and SiLU-gated MLP,
# rotary embedding on every dimension, RMSNorms (Qwen3's also on each q and k head)
LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")


def unsupported(decoder: nn.Module) -> str | None:
    """Why ``FusedDecode`` cannot run ``decoder`` (a transformers base model after
    ``engine.weights.optimize_cuda_layout``), or None when it can."""
    layer = decoder.layers[0]
    if type(layer).__name__ not in LAYERS:  # the checks below read these layers' modules
        return f"{type(layer).__name__} is not one of {', '.join(LAYERS)}"
    attn, mlp, config = layer.self_attn, layer.mlp, decoder.config
    rope = getattr(config, "rope_parameters", None) or {}
    checks = (
        (isinstance(attn.q_proj, FusedLinear) and isinstance(mlp.gate_proj, FusedLinear), "projections not fused"),
        (type(attn.o_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear, "a tensor-parallel shard"),
        (getattr(config, "hidden_act", None) == "silu", f"activation {getattr(config, 'hidden_act', None)!r}"),
        (rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) == 1.0, "partial rotary"),
        (all(type(n).__name__ in RMS_NORMS for n in (layer.input_layernorm, decoder.norm)), "another norm"),
    )
    return next((reason for ok, reason in checks if not ok), None)


@dataclass(frozen=True)
class _Layer:
    qkv: FusedLinear
    o_proj: nn.Module
    post_norm: torch.Tensor
    gate_up: FusedLinear
    down_proj: nn.Module
    next_norm: torch.Tensor  # the next layer's input norm, or the final norm
    qk_norm: QKNorm | None


class FusedDecode:
    """``forward(static)`` -> float32 logits ``[batch, vocab]``, as ``ModelRunner``'s graph
    forward; ``kernels``: Triton's on a GPU (torch ops anywhere)."""

    def __init__(self, decoder: nn.Module, lm_head: nn.Module, pool: KVPool, kernels: DecodeKernels) -> None:
        reason = unsupported(decoder)
        if reason is not None:
            raise ValueError(f"fused decode kernels cannot run this model: {reason}")
        layers = decoder.layers
        self.kernels = kernels
        self.pool = pool
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.lm_head = lm_head
        self.first_norm = layers[0].input_layernorm.weight
        self.eps = layers[0].input_layernorm.variance_epsilon
        attn = layers[0].self_attn
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.scale = attn.scaling
        norms = [layer.input_layernorm.weight for layer in layers[1:]] + [decoder.norm.weight]
        self.layers = [
            _Layer(layer.self_attn.q_proj, layer.self_attn.o_proj, layer.post_attention_layernorm.weight,
                   layer.mlp.gate_proj, layer.mlp.down_proj, norm, _qk_norm(layer.self_attn))
            for layer, norm in zip(layers, norms)
        ]  # fmt: skip

    def __call__(self, static: StaticDecode) -> torch.Tensor:
        k, pool, eps = self.kernels, self.pool, self.eps
        residual = self.embed(static.token_ids)  # [batch, hidden]; the residual stream, added to in place
        cos, sin = (t[0] for t in self.rotary(residual[None], static.positions[None]))
        x = k.add_rms_norm(residual, None, self.first_norm, eps)
        for i, layer in enumerate(self.layers):
            q = k.rope_write_kv(layer.qkv.fused(x), cos, sin, static.slots, pool.key_slots(i), pool.value_slots(i),
                                self.num_heads, layer.qk_norm)  # fmt: skip
            o = k.paged_decode_attention(
                q, pool.key_blocks(i), pool.value_blocks(i), static.block_tables, static.lengths, self.scale
            )
            x = k.add_rms_norm(layer.o_proj(o.view(o.shape[0], -1)), residual, layer.post_norm, eps)
            x = k.add_rms_norm(layer.down_proj(k.silu_mul(layer.gate_up.fused(x))), residual, layer.next_norm, eps)
        return self.lm_head(x).float()


def _qk_norm(attn: nn.Module) -> QKNorm | None:
    """The attention's per-head norms of q and k (Qwen3), or None."""
    if getattr(attn, "q_norm", None) is None:
        return None
    return QKNorm(attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon)
