"""Sampling as small pure functions over a batch of logits rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.params import SamplingParams, TokenLogprobs


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of a 1-D row (ties at the k-th value kept)."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p (always >= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token from a 1-D float32 logits row: a 0-d tensor on the row's device, not read
    back (``generator``, when given, lives on that device)."""
    if params.greedy:
        return torch.argmax(logits)
    logits = logits / params.temperature
    if params.top_k is not None:
        logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """One token per row; greedy rows in one argmax, the others row by row with their generator.
    The ids are read back from the logits' device once, at the end (one sync on CUDA)."""
    tokens = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = sample_row(logits[i], p, generators[i])
    return tokens.tolist()


def token_logprobs(logits_row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """Log-probability of ``token_id`` and the ``num_top`` most likely tokens (raw model distribution)."""
    logprobs = torch.log_softmax(logits_row, dim=-1)
    top = torch.topk(logprobs, num_top) if num_top else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprobs(token_id=token_id, logprob=float(logprobs[token_id]), top=pairs)
