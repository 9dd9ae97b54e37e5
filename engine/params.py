"""Request-level parameters and the result types that cross the engine's seams.

``SamplingParams`` validates itself on construction: every invalid field raises a
``ValueError`` that names the field, before the engine allocates anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

# below this temperature sampling is greedy (as vLLM does): dividing the logits by a
# smaller one overflows them to inf, and softmax then gives NaN
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


class Role(StrEnum):
    """What an engine replica does with the requests it admits.

    ``prefill``: run the prompt, sample the first token, keep the blocks pinned until
    ``release``. ``decode``: continue from KV placed in reserved blocks. ``both``: the
    whole request. The role is state, not code: it can change while the engine runs.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the engine could not finish it (see RequestOutput.error)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below ``GREEDY_BELOW`` (0 included) is greedy. ``top_k=None`` and
    ``top_p=1.0`` disable those filters.
    ``seed`` makes sampling reproducible per request, independent of batch neighbours.
    ``logprobs=n`` returns the top-n log-probabilities of every generated token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a finite number in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return tuple(stop)


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: already tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        ids = self.prompt_token_ids
        if isinstance(ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError("prompt must be a list of non-negative token ids")
        if len(ids) == 0:
            raise ValueError("prompt must not be empty")
        object.__setattr__(self, "prompt_token_ids", tuple(ids))


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and the end."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    error: str | None = None
    # set when a prefill-only request ends its prefill phase with its KV pinned
    pinned_block_ids: tuple[int, ...] = ()
    # on the first token of a prompt computed here: (seconds queued, seconds computing)
    prefill_timing: tuple[float, float] | None = None


@dataclass(frozen=True)
class PrefillResult:
    """The outcome of ``prefill``: the first token and where the prompt's KV sits.

    If ``finish_reason`` is set the request already ended at its first token (EOS or
    ``max_tokens == 1``); its blocks were freed and ``block_ids`` is empty. Otherwise the
    blocks stay pinned until ``release(request_id)``.
    """

    request_id: str
    first_token: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_text: str
    finish_reason: FinishReason | None = None
    first_logprobs: TokenLogprobs | None = None
    queue_s: float = 0.0  # admitted -> first prompt chunk scheduled
    compute_s: float = 0.0  # first prompt chunk -> first token

    @classmethod
    def from_output(cls, output: RequestOutput) -> PrefillResult:
        """Build from the final output of a prefill-only request."""
        return cls(
            request_id=output.request_id,
            first_token=output.token_ids[0],
            block_ids=output.pinned_block_ids,
            num_tokens=output.num_prompt_tokens,
            first_text=output.text,
            finish_reason=output.finish_reason,
            first_logprobs=output.logprobs[0] if output.logprobs else None,
            queue_s=output.prefill_timing[0] if output.prefill_timing else 0.0,
            compute_s=output.prefill_timing[1] if output.prefill_timing else 0.0,
        )


@dataclass(frozen=True)
class EngineStats:
    role: Role
    num_total_blocks: int
    num_free_blocks: int
    num_pinned_blocks: int
    num_reserved_blocks: int
    num_running: int
    num_waiting: int
    block_size: int
    num_preemptions: int  # since start
    median_step_ms: float  # median time of the last 64 steps that ran the model
