"""Sampling as small pure functions over a batch of logits rows.

Logits processing (``logit_bias``, the penalties) works on the whole batch with index and
scatter ops: rows that ask for none of it are not touched, and no Python loop runs over the
vocabulary. What a penalty needs from a request's past (token counts, the prompt's tokens)
is kept per request in ``TokenHistory``, rebuilt from the tokens alone, so a decode replica
that continues a request rebuilds it from the prompt and the first token it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(eq=False)
class TokenHistory:
    """One request's tokens as penalties need them, as tensors of the vocabulary's width on
    the logits' device: ``counts[t]`` = times ``t`` was generated so far; ``in_prompt[t]`` =
    ``t`` is in the prompt (only kept when ``repetition_penalty`` != 1)."""

    counts: torch.Tensor
    in_prompt: torch.Tensor | None

    @classmethod
    def build(
        cls, params: SamplingParams, prompt: Sequence[int], vocab_size: int, device: torch.device
    ) -> TokenHistory | None:
        """None when the request has no penalty (nothing to keep)."""
        if not params.penalized:
            return None
        in_prompt = None
        if params.repetition_penalty != 1:
            in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            in_prompt[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        return cls(torch.zeros(vocab_size, dtype=torch.float32, device=device), in_prompt)

    def add(self, token: int) -> None:
        """Count one generated token (called for every token appended, the first included)."""
        self.counts[token] += 1


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` in place: one ``index_put_`` for the whole batch."""
    rows, ids, values = [], [], []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(row)
            ids.append(token)
            values.append(bias)
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]
) -> None:
    """Repetition, then presence and frequency penalties, in place, on the rows that have a
    history (gathered into one ``(rows, vocab)`` block, processed, scattered back)."""
    rows = [i for i, h in enumerate(histories) if h is not None]
    if not rows:
        return
    device, dtype = logits.device, logits.dtype
    index = torch.tensor(rows, device=device)
    block = logits.index_select(0, index)
    counts = torch.stack([histories[i].counts for i in rows])
    generated = counts > 0

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], dtype=dtype, device=device).unsqueeze(1)

    repetition = column("repetition_penalty")
    seen = generated | torch.stack([_prompt_mask(histories[i], generated[0]) for i in rows])
    penalized = torch.where(block > 0, block / repetition, block * repetition)
    block = torch.where(seen, penalized, block)
    block -= column("presence_penalty") * generated + column("frequency_penalty") * counts
    logits.index_copy_(0, index, block)


def _prompt_mask(history: TokenHistory, like: torch.Tensor) -> torch.Tensor:
    return history.in_prompt if history.in_prompt is not None else torch.zeros_like(like)
