"""Tiny random-weight models of real transformers families, built from a config in code (no download)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from engine.loader import LoadedModel

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config}
# families built here but not in every comparison that runs over FAMILIES
MORE_FAMILIES = {"qwen3": Qwen3Config}


SHARP = 1.0  # an initializer range that makes attention near one-hot: see tiny_config


def tiny_config(family: str, initializer_range: float = 0.02) -> PretrainedConfig:
    """3 layers, hidden 64, 4 query heads sharing 2 KV heads, vocabulary 512; no EOS, so a
    comparison always runs its full number of tokens.

    With transformers' default ``initializer_range`` (0.02) attention is near uniform, so a
    wrong or missing KV block barely moves a token; with ``SHARP`` each query attends to few
    keys and the logits lie far apart, so such a mix-up changes the tokens (tests of the KV
    machinery use it)."""
    config = (FAMILIES | MORE_FAMILIES)[family](
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # Qwen3's default is 128, not hidden / heads
        max_position_embeddings=1024,
        initializer_range=initializer_range,
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


def random_ids(num_tokens: int, seed: int, vocab_size: int = 512) -> list[int]:
    """``num_tokens`` seeded random token ids of a tiny model's vocabulary (0 left out)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (num_tokens,), generator=generator).tolist()


TINY_SERVED_NAME = "tiny-smollm2"  # the name clients send to an app serving save_tiny_served


@dataclass(frozen=True)
class TinyServed:
    """``save_tiny_served``'s model: the app arguments that serve it, and the same weights
    loaded in the test process (for the engine references served outputs are compared with);
    the ``tiny_served`` fixture of tests/conftest.py."""

    args: dict[str, str]
    loaded: LoadedModel


def save_tiny_served(folder: Path, default: LoadedModel) -> dict[str, str]:
    """A tiny random-weight Llama with the default model's (``default``) tokenizer, vocabulary
    and chat template, saved in ``folder`` as a model directory an app serves
    (``model.source``); returns the app arguments that serve it as ``TINY_SERVED_NAME``.

    8 layers of width 96, 6 query heads sharing 3 KV heads (split over 3 tensor-parallel ranks
    as the default model's are), near one-hot attention (``SHARP``): a wrong or missing KV
    block changes its tokens. For served tests whose subject is not the model (failures, API
    keys, parallelism, placement), where the default model's decoding only adds time; the
    default model's own served output is tested in tests/deployments/test_serve_app.py."""
    config = copy.deepcopy(default.model.config)
    config.update(
        {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 8, "head_dim": 16}
        | {"num_attention_heads": 6, "num_key_value_heads": 3, "initializer_range": SHARP}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    default.tokenizer.save_pretrained(folder)
    return {"model.source": str(folder), "model.served_name": TINY_SERVED_NAME}
