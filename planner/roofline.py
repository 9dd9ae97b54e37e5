"""Analytic cost model: a roofline of one replica from a model's ``config.json`` and a GPU's specs.

Every forward pass of a decoder-only transformer is, per layer, a set of GEMMs over the
layer's weights plus attention over the KV cache. Its time on one replica of ``tp`` GPUs
(Megatron tensor parallelism: each GPU holds 1/tp of every layer) is::

    layer_s = max(flops / tp / (peak_flops * mfu),                      # compute-bound (prefill)
                  (weight_bytes + kv_bytes_read) / tp / (hbm_bw * bw_eff)) # memory-bound (decode)
              + 2 * allreduce_s(tokens * hidden * dtype_bytes)             # attention out + MLP out
    allreduce_s(b) = 2 * (tp - 1) / tp * b / (nvlink_bw * link_eff) + allreduce_latency_s   # ring; 0 at tp=1
    forward_s = num_layers * layer_s + lm_head + step_overhead_s

KV moves between a prefill and a decode replica over the network (the two pools live on
different node groups: ``prefill_node`` / ``decode_node``), each of the ``tp`` GPUs sending its
shard through its own NIC: ``transfer_s = transfer_latency_s + bytes / (tp * network_bw * link_eff)``.

The efficiency factors are explicit defaults of ``RooflineCost`` (see ``Efficiency``); the
peak figures come from ``planner/hardware/*.yaml`` with their sources.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

HARDWARE_DIR = Path(__file__).parent / "hardware"
_NOT_GATED = frozenset({"opt", "gpt2", "gpt_neox", "gptj", "falcon", "bloom"})  # 2-matrix MLPs


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one GPU (per GPU, per direction for links); ``source``: where they come from."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    source: tuple[str, ...]
    gpus_per_node: int = 8
    description: str = ""


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped GPU by name (``h100``, ``h200``, ``a100``, ``l40s``) or a YAML file of the same fields."""
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path.lower()}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        raise ValueError(f"unknown GPU {name_or_path!r}: not a file, and not one of {shipped}")
    data = yaml.safe_load(path.read_text())
    numbers = ("bf16_flops", "hbm_bytes_per_s", "hbm_bytes", "nvlink_bytes_per_s", "network_bytes_per_s")
    missing = [key for key in (*numbers, "source") if key not in data]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    return Hardware(
        name=str(data.get("name", path.stem)),
        source=tuple(data["source"]),
        gpus_per_node=int(data.get("gpus_per_node", 8)),
        description=str(data.get("description", "")),
        **{key: float(data[key]) for key in numbers},
    )


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a decoder-only transformer's FLOPs and bytes.

    ``intermediate_size`` is the MLP's inner width; ``gated_mlp`` (SwiGLU: gate, up, down) has
    3 matrices, the OPT/GPT style 2. ``embed_dim`` is OPT's ``word_embed_proj_dim`` (= hidden
    elsewhere). Biases and norms are left out (under 0.1% of the weights).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    gated_mlp: bool = True
    tie_word_embeddings: bool = False
    embed_dim: int | None = None
    dtype_bytes: int = 2
    name: str = ""

    @cached_property  # the simulator asks once per step
    def layer_params(self) -> int:
        """Weights of one layer: Q, K, V, O projections and the MLP."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return attention + mlp

    @cached_property
    def matmul_params(self) -> int:
        """Weights every token multiplies through (all layers; not the embeddings)."""
        return self.num_layers * self.layer_params

    @cached_property
    def lm_head_params(self) -> int:
        embed = self.embed_dim or self.hidden_size
        projection = 0 if embed == self.hidden_size else embed * self.hidden_size
        return self.vocab_size * embed + projection

    @cached_property
    def params(self) -> int:
        """All weights: layers, input embedding, and the LM head unless it is tied to the embedding."""
        embed = self.embed_dim or self.hidden_size
        embeddings = self.vocab_size * embed + (0 if embed == self.hidden_size else 2 * embed * self.hidden_size)
        untied_head = 0 if self.tie_word_embeddings else self.vocab_size * embed
        return self.matmul_params + embeddings + untied_head

    @cached_property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @cached_property
    def attention_width(self) -> int:
        return self.num_heads * self.head_dim


MODELS_DIR = Path(__file__).parent / "models"  # shapes shipped by name: llama-1b, llama-8b
REQUIRED = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size")


def _read_config(config: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(config, dict):
        return config, str(config.get("_name_or_path", config.get("model_type", "")))
    path = Path(config)
    if not path.exists() and (MODELS_DIR / f"{config}.json").exists():
        path = MODELS_DIR / f"{config}.json"
        return json.loads(path.read_text()), path.stem
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text()), path.parent.name


def model_shape(config: str | Path | dict[str, Any], dtype_bytes: int = 2) -> ModelShape:
    """A ``ModelShape`` from a Hugging Face ``config.json`` (a path, its directory, the dict, or
    the name of a shape in ``planner/models/``).

    Reads Llama/Mistral/Qwen names (``intermediate_size``, ``num_key_value_heads``) and OPT's
    (``ffn_dim``, ``word_embed_proj_dim``; no KV heads: as many as attention heads).
    ``dtype_bytes``: the serving precision (2: bf16/fp16, the GPUs' Tensor Core rate used here).
    """
    data, name = _read_config(config)
    if missing := [key for key in REQUIRED if key not in data]:
        raise ValueError(f"the model config lacks {', '.join(missing)} (the cost model needs them)")
    heads = int(data["num_attention_heads"])
    hidden = int(data["hidden_size"])
    inner = data.get("intermediate_size", data.get("ffn_dim"))
    if inner is None:
        raise ValueError("config.json has neither intermediate_size nor ffn_dim")
    model_type = str(data.get("model_type", "")).lower()
    embed = data.get("word_embed_proj_dim")
    return ModelShape(
        num_layers=int(data["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads),
        intermediate_size=int(inner),
        vocab_size=int(data["vocab_size"]),
        max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
        gated_mlp=model_type not in _NOT_GATED and "ffn_dim" not in data,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
        embed_dim=int(embed) if embed else None,
        dtype_bytes=dtype_bytes,
        name=name,
    )


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a real engine reaches; documented defaults, override per study.

    * ``mfu`` 0.55: prefill GEMMs of a few thousand tokens reach 50-70% of dense BF16 peak in
      vLLM/TensorRT-LLM; 0.55 sits at the careful end.
    * ``hbm`` 0.80: decode streams weights and KV at 75-90% of the datasheet bandwidth.
    * ``link`` 0.80: NCCL ring all-reduce bus bandwidth and RDMA goodput reach ~80% of the link.
    * ``allreduce_latency_s`` 10 us: NCCL's small-message all-reduce latency within a node.
    * ``transfer_latency_s`` 0.5 ms: per KV transfer (handshake, descriptors, completion).
    * ``step_overhead_s`` 1 ms: per forward (scheduling, kernel launches, sampling).
    * ``memory_utilization`` 0.90 and ``activation_reserve_bytes`` 2 GB per GPU: the share of
      memory the engine may use (vLLM's default) and what it keeps for activations; the KV pool
      gets the rest after the weights.
    """

    mfu: float = 0.55
    hbm: float = 0.80
    link: float = 0.80
    allreduce_latency_s: float = 10e-6
    transfer_latency_s: float = 0.5e-3
    step_overhead_s: float = 1e-3
    memory_utilization: float = 0.90
    activation_reserve_bytes: float = 2e9


@dataclass(frozen=True)
class RooflineCost:
    """``planner.costs.CostModel`` for one replica of ``tp`` GPUs (see the module docstring)."""

    shape: ModelShape
    hardware: Hardware
    tp: int = 1
    efficiency: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    # -- the parts, each for the whole replica ---------------------------------------------
    def prefill_flops(self, tokens: int) -> float:
        """2 * matmul_params * tokens + causal attention (QK^T and AV over tokens^2 / 2 pairs,
        as one sequence: the upper bound for a batch of this many tokens) + one LM-head row."""
        shape = self.shape
        attention = 2 * shape.num_layers * tokens * tokens * shape.attention_width
        return 2 * shape.matmul_params * tokens + attention + 2 * shape.lm_head_params

    def decode_flops(self, batch_size: int, context_tokens: int) -> float:
        shape = self.shape
        attention = 4 * shape.num_layers * context_tokens * shape.attention_width
        return 2 * (shape.matmul_params + shape.lm_head_params) * batch_size + attention

    def forward_bytes(self, kv_tokens_read: int) -> float:
        """Bytes one forward streams from memory: every layer's weights, the LM head, the KV read."""
        shape = self.shape
        weights = (shape.matmul_params + shape.lm_head_params) * shape.dtype_bytes
        return weights + kv_tokens_read * shape.kv_bytes_per_token

    def allreduce_s(self, num_bytes: float) -> float:
        """One ring all-reduce of ``num_bytes`` across the replica's GPUs (0 without TP)."""
        if self.tp == 1:
            return 0.0
        link = self.hardware.nvlink_bytes_per_s * self.efficiency.link
        return 2 * (self.tp - 1) / self.tp * num_bytes / link + self.efficiency.allreduce_latency_s

    def _forward_s(self, flops: float, num_bytes: float, tokens: int) -> float:
        eff, hw = self.efficiency, self.hardware
        compute_s = flops / self.tp / (hw.bf16_flops * eff.mfu)
        memory_s = num_bytes / self.tp / (hw.hbm_bytes_per_s * eff.hbm)
        activations = tokens * self.shape.hidden_size * self.shape.dtype_bytes
        communication_s = 2 * self.shape.num_layers * self.allreduce_s(activations)
        return max(compute_s, memory_s) + communication_s + eff.step_overhead_s

    # -- CostModel ----------------------------------------------------------------------------
    def prefill_s(self, batch_tokens: int) -> float:
        """One prefill forward over ``batch_tokens`` prompt tokens (writes their KV)."""
        num_bytes = self.forward_bytes(batch_tokens)
        return self._forward_s(self.prefill_flops(batch_tokens), num_bytes, batch_tokens)

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of ``batch_size`` requests whose KV lengths sum to ``context_tokens``:
        ``_forward_s(decode_flops, forward_bytes, batch_size)``, with its terms linear in the batch
        and the context worked out once (the simulator asks for every step)."""
        if batch_size <= 0:
            return 0.0
        per_row, per_kv, weights, kv_read, fixed, comm_row = self._decode_terms
        compute = per_row * batch_size + per_kv * context_tokens
        memory = weights + kv_read * context_tokens
        return (compute if compute > memory else memory) + fixed + comm_row * batch_size

    @cached_property
    def _decode_terms(self) -> tuple[float, float, float, float, float, float]:
        """``_forward_s``'s parts for a decode step, read off ``decode_flops``, ``forward_bytes`` and
        ``allreduce_s`` (each linear): seconds of compute per row and per KV token, of memory for
        the weights and per KV token, fixed, and of all-reduce per row."""
        eff, hw, shape = self.efficiency, self.hardware, self.shape
        flops_rate, bytes_rate = self.tp * hw.bf16_flops * eff.mfu, self.tp * hw.hbm_bytes_per_s * eff.hbm

        def communication_s(rows: int) -> float:
            return 2 * shape.num_layers * self.allreduce_s(rows * shape.hidden_size * shape.dtype_bytes)

        weights = self.forward_bytes(0)
        return (
            self.decode_flops(1, 0) / flops_rate,
            self.decode_flops(0, 1) / flops_rate,
            weights / bytes_rate,
            (self.forward_bytes(1) - weights) / bytes_rate,
            eff.step_overhead_s + communication_s(0),
            communication_s(1) - communication_s(0),
        )

    def transfer_s(self, num_bytes: int) -> float:
        """One KV transfer to a replica on another node: latency + bytes over the tp NICs."""
        link = self.tp * self.hardware.network_bytes_per_s * self.efficiency.link
        return self.efficiency.transfer_latency_s + num_bytes / link

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token

    @cached_property
    def kv_pool_bytes(self) -> float:
        """KV pool of the replica: per GPU, usable memory - weights/tp - activation reserve."""
        eff = self.efficiency
        per_gpu = self.hardware.hbm_bytes * eff.memory_utilization - eff.activation_reserve_bytes
        return max(0.0, self.tp * per_gpu - self.shape.weight_bytes)

    @cached_property
    def kv_capacity_tokens(self) -> int:
        return int(self.kv_pool_bytes // self.shape.kv_bytes_per_token)

    def fits(self, max_model_len: int) -> bool:
        """The weights fit and the pool holds at least one full-context request."""
        return self.kv_capacity_tokens >= max_model_len
