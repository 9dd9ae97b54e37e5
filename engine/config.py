"""Engine settings: a frozen dataclass with the values the engine needs, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from engine.params import Role

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and KV-pool settings of one engine.

    ``num_blocks`` fixes the pool size; otherwise it is ``kv_cache_bytes`` divided by
    the bytes of one block. ``max_model_len`` defaults to the model's context length.
    ``recompute_remote_kv`` allows a decode replica to re-run prefill for a preempted
    request whose KV came from another replica (off: such requests are never preempted
    by recompute; see ``engine.scheduler``). ``cpu_packed_weights`` (CPU only) keeps a
    second, oneDNN-blocked copy of the weights for batched decode and prefill: about 30%
    off a 4-sequence decode step for the weights' memory once more (``engine.cpu_matmul``).
    """

    block_size: int = 16
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    role: Role = Role.BOTH
    recompute_remote_kv: bool = False
    cpu_packed_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        object.__setattr__(self, "role", Role(self.role))


@dataclass(frozen=True)
class ResolvedLimits:
    """The limits once the model is known (context length, pool size, token budget)."""

    max_model_len: int
    num_blocks: int
    max_num_batched_tokens: int


def resolve_limits(config: EngineConfig, model_max_len: int, bytes_per_block: int) -> ResolvedLimits:
    """Fill in the defaults that depend on the model and check that they fit together."""
    max_model_len = config.max_model_len or model_max_len
    if max_model_len > model_max_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_max_len}")
    num_blocks = config.num_blocks or config.kv_cache_bytes // bytes_per_block
    blocks_per_request = -(-max_model_len // config.block_size)
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {config.block_size} tokens "
            f"({num_blocks * bytes_per_block} bytes, {bytes_per_block} bytes per block) cannot hold one "
            f"request of max_model_len={max_model_len} tokens, which needs {blocks_per_request} blocks "
            f"({blocks_per_request * bytes_per_block} bytes); raise kv_cache_bytes or lower max_model_len"
        )
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = 512 if config.enable_chunked_prefill else max(2048, max_model_len)
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={budget} < max_model_len={max_model_len}: without chunked prefill a "
            "full-context prompt could never be scheduled; enable chunked prefill or raise the budget"
        )
    return ResolvedLimits(max_model_len=max_model_len, num_blocks=num_blocks, max_num_batched_tokens=budget)
