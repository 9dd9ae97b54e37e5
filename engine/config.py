"""Engine settings, declared once: ``EngineSettings`` holds the fields an operator sets (the
application's ``engine`` section is this class with the app's own default pool size);
``EngineConfig`` adds what only the engine's caller knows (role, fixed pool, context)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.params import Role

DEFAULT_KV_CACHE_BYTES = 1 << 30  # the engine's own default; the served app uses 256 MiB
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class EngineSettings(BaseModel):
    """Scheduling and KV-pool settings of one engine (validated on construction).

    ``recompute_remote_kv`` allows a decode replica to re-run prefill for a preempted request
    whose KV came from another replica (off: such a request stalls instead, and is recomputed
    only when nothing else could run; see ``engine.scheduler``). ``cpu_packed_weights`` (CPU
    only) keeps a second, oneDNN-blocked copy of the weights for batched decode and prefill
    (``engine.cpu_matmul``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(16, ge=1, description="tokens per KV block")
    kv_cache_bytes: int = Field(DEFAULT_KV_CACHE_BYTES, ge=1, description="KV pool size per engine rank, in bytes")
    max_num_seqs: int = Field(64, ge=1, description="most requests running at once per replica")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="token budget of one engine step")
    enable_chunked_prefill: bool = Field(False, description="split long prompts across steps")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of cached full blocks of a prompt's prefix (hash-chained keys)"
    )
    recompute_remote_kv: bool = Field(
        False, description="preempt remote-KV requests like others (off: they stall; recomputed only if nothing runs)"
    )
    cpu_packed_weights: bool = Field(
        True, description="CPU: keep a oneDNN-packed copy of the weights for batched steps (faster, 2x weight memory)"
    )
    cuda_graphs: bool = Field(
        True, description="CUDA: replay decode steps from CUDA graphs captured per batch size (no effect on CPU)"
    )
    cuda_decode_kernels: bool = Field(
        True,
        description="CUDA: decode graphs run fused Triton kernels (Llama, Qwen2/3, Mistral); off: the model's forward",
    )
    cuda_graph_batch_sizes: tuple[Annotated[int, Field(ge=1)], ...] = Field(
        DEFAULT_CUDA_GRAPH_BATCH_SIZES,
        min_length=1,
        description="CUDA: batch sizes with a decode graph; a batch is padded up to the next, larger ones run eagerly",
    )

    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto",
        description="prepare the next decode step while the device runs this one (engine.overlap); "
        "auto: where decode steps replay from CUDA graphs; on: everywhere (no gain on CPU)",
    )

    def graph_batch_sizes(self) -> tuple[int, ...] | None:
        """What ``ModelRunner`` takes: the graph batch sizes, or None when graphs are off."""
        return tuple(sorted(set(self.cuda_graph_batch_sizes))) if self.cuda_graphs else None


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's names): ``ngram`` proposes the tokens that followed the latest
    earlier occurrence of the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens
    (prompt and output), and one forward verifies them (``engine.speculative``).

    ``disable_by_batch_size``: a step with more running requests than this proposes nothing
    (verifying costs more than it saves in a full batch; the measurement:
    ``docs/benchmarks/speculative.md``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["none", "ngram"] = Field("none", description="'none' (off) or 'ngram' (prompt lookup)")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="tokens proposed per step (k)")
    prompt_lookup_min: int = Field(2, ge=1, description="shortest n-gram matched")
    prompt_lookup_max: int = Field(4, ge=1, description="longest n-gram matched (tried first)")
    disable_by_batch_size: int = Field(
        16, ge=1, description="no proposals in a step with more running requests than this"
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class EngineConfig(EngineSettings):
    """``EngineSettings`` plus the engine-only values: ``num_blocks`` fixes the pool size
    (otherwise ``kv_cache_bytes`` / bytes per block), ``max_model_len`` defaults to the
    model's context length, ``role`` is the initial role."""

    num_blocks: int | None = Field(None, ge=1, description="pool size in blocks (overrides kv_cache_bytes)")
    max_model_len: int | None = Field(None, ge=1, description="context length served (default: the model's)")
    role: Role = Field(Role.BOTH, description="initial role (it can change while the engine runs)")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig, description="speculative decoding")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split over (engine.tensor_parallel)")


def check_token_budget(budget: int | None, chunked: bool, max_model_len: int, section: str = "") -> None:
    """Without chunked prefill a whole prompt runs in one step, so the step's token budget must
    hold a full-context prompt. ``section`` prefixes the field names (``engine.`` in the app)."""
    if budget is not None and not chunked and budget < max_model_len:
        raise ValueError(
            f"{section}max_num_batched_tokens={budget} < max_model_len={max_model_len}: without chunked "
            f"prefill a full-context prompt could never be scheduled; needs {section}enable_chunked_prefill=true "
            "or a larger budget"
        )


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
    check_token_budget(budget, config.enable_chunked_prefill, max_model_len)
    return ResolvedLimits(max_model_len=max_model_len, num_blocks=num_blocks, max_num_batched_tokens=budget)
