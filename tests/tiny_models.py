"""Tiny random-weight models of real transformers families, built from a config in code (no download)."""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny_config(family: str) -> PretrainedConfig:
    """3 layers, hidden 64, 4 query heads sharing 2 KV heads, vocabulary 512; no EOS, so a
    comparison always runs its full number of tokens."""
    config = FAMILIES[family](
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    config.eos_token_id = None
    return config


def tiny_tp_config(family: str, kv_heads: int = 4) -> PretrainedConfig:
    """``tiny_config`` with 8 query heads (head_dim 8) and ``kv_heads`` KV heads: splits over 2 and 4
    tensor-parallel ranks (and, with 2 KV heads, replicates each over 2 of 4 ranks)."""
    config = tiny_config(family)
    config.num_attention_heads, config.num_key_value_heads = 8, kv_heads
    config.head_dim = config.hidden_size // 8
    return config
