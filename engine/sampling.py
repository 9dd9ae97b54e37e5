"""Sampling as small pure functions over a batch of logits rows.

Logits processing (``logit_bias``, the penalties) works on the whole batch with gather and
scatter ops over the (row, token) pairs concerned: rows that ask for none of it are not
touched, and nothing runs over the vocabulary (a pass over a whole batch of logits is a
sizeable share of a CPU decode step: ``docs/benchmarks/cpu_kernels.md``). What a penalty
needs from a request's past is kept per request in ``TokenHistory``, built from the tokens
alone, so a decode replica that continues a request rebuilds it from the prompt and the first
token it was given.
"""

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
    drop = mass_before >= p
    drop[0] = False  # the most likely token stays even when p rounds to 0 in float32 (all -inf: NaN)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the tokens of a 1-D row less likely than ``min_p`` times its most likely one."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, min-p, top-k, top-p (vLLM's
    order), softmax."""
    logits = apply_min_p(logits / params.temperature, params.min_p)
    if params.top_k is not None:
        logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token from a 1-D float32 logits row: a 0-d tensor on the row's device, not read
    back (``generator``, when given, lives on that device)."""
    if params.greedy:
        return torch.argmax(logits)
    return draw(sampling_probs(logits, params), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index drawn from ``probs``: argmax of p / q, q ~ Exp(1), what ``torch.multinomial``
    does for one sample (the same draws from the same generator), without its checks of the
    probabilities, which read them back: on CUDA a wait for everything queued before."""
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1, generator=generator))


def verify_token(
    probs: torch.Tensor, draft: int, generator: torch.Generator | None, draft_probs: torch.Tensor | None = None
) -> int:
    """Speculative sampling's accept/resample step: the proposal ``draft`` (drawn from
    ``draft_probs``; None: proposed for sure, as prompt lookup does) is kept with probability
    min(1, p(draft) / q(draft)); otherwise a token is drawn from max(p - q, 0), normalized. The
    token returned is distributed exactly as ``probs`` (Leviathan et al., 2023)."""
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft])
    u = torch.rand((), device=probs.device, generator=generator)
    if float(u) * q_draft < float(probs[draft]):
        return draft
    if draft_probs is None:
        residual = probs.clone()
        residual[draft] = 0.0
    else:
        residual = (probs - draft_probs).clamp_min(0.0)
    if not float(residual.sum()) > 0.0:  # p == q: never reached with probability > 0 (NaN: a fully masked row)
        return draft
    return int(torch.multinomial(residual, 1, generator=generator)[0])


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    drafts: Sequence[int | None] = (),
) -> list[int]:
    """One token per row; greedy rows in one argmax, the others row by row with their generator.
    A row with a proposal (``drafts[i]`` not None) that samples goes through ``verify_token``.
    The ids are read back from the logits' device once, at the end (one sync on CUDA)."""
    return sample_tokens(logits, params, generators, drafts).tolist()


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    drafts: Sequence[int | None] = (),
) -> torch.Tensor:
    """``sample_batch``'s tokens as an int64 tensor on the logits' device; without proposals
    nothing is read back (the asynchronous scheduling's path: ``engine.overlap``)."""
    tokens = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        draft = drafts[i] if drafts else None
        if draft is None:
            tokens[i] = sample_row(logits[i], p, generators[i])
        else:
            tokens[i] = verify_token(sampling_probs(logits[i], p), draft, generators[i])
    return tokens


def batch_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs`` of every row at once, on the logits' device, nothing read back: each
    row's token's log-probability ``[rows]``, and its ``num_top`` most likely tokens' ids and
    log-probabilities ``[rows, num_top]``."""
    return _picked(torch.log_softmax(logits, dim=-1), tokens, num_top)


def _picked(logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """Each row's token's log-probability and its ``num_top`` most likely tokens (``batch_logprobs``)."""
    top = torch.topk(logprobs, num_top, dim=-1)
    return logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), top.indices, top.values


def rows_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int, ranked: bool = False
) -> list[TokenLogprobs]:
    """``batch_logprobs`` of each row of ``logits`` for its own token, read back; ``ranked``: with
    each token's rank, as vLLM's (how many tokens of its row are at least as likely, itself included)."""
    tokens = torch.tensor(token_ids, device=logits.device)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen, top_ids, top_values = _picked(logprobs, tokens, num_top)
    ranks = [None] * len(token_ids)
    if ranked:  # on the log-probabilities the top ones are picked from: a token among them is ranked where it stands
        ranks = (logprobs >= chosen[:, None]).sum(dim=1).tolist()
    chosen, top_ids, top_values = chosen.tolist(), top_ids.tolist(), top_values.tolist()
    return [
        TokenLogprobs(token_id=token, logprob=value, top=tuple(zip(ids, values)), rank=rank)
        for token, value, ids, values, rank in zip(token_ids, chosen, top_ids, top_values, ranks)
    ]


def token_logprobs(logits_row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """Log-probability of ``token_id`` and the ``num_top`` most likely tokens (raw model
    distribution): ``rows_logprobs`` of one row."""
    return rows_logprobs(logits_row[None], [token_id], num_top)[0]


class TokenHistory:
    """One request's past as its penalties need it, kept sparse (the tokens it holds, not the
    vocabulary) and updated per token, as 1-D tensors on the logits' device:

        generated[k]  the k-th distinct token generated so far
        offsets[k]    what presence and frequency subtract from it:
                      presence_penalty + frequency_penalty * (times generated)
        seen          distinct tokens of the prompt and the output (kept only when
                      repetition_penalty != 1)
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int], device: torch.device) -> None:
        self._presence, self._frequency = params.presence_penalty, params.frequency_penalty
        self._device = device
        self._position: dict[int, int] = {}  # token -> its index in ``generated``
        self.generated = torch.zeros(0, dtype=torch.long, device=device)
        self.offsets = torch.zeros(0, dtype=torch.float32, device=device)
        self._seen: set[int] | None = None
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1:
            self._seen = set(prompt)
            self.seen = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)

    @classmethod
    def build(cls, params: SamplingParams, prompt: Sequence[int], device: torch.device) -> TokenHistory | None:
        """None when the request has no penalty (nothing to keep)."""
        return cls(params, prompt, device) if params.penalized else None

    def add(self, token: int) -> None:
        """Count one generated token (called for every token appended, the first included)."""
        position = self._position.get(token)
        if position is not None:
            self.offsets[position] += self._frequency
            return
        self._position[token] = len(self._position)
        new = torch.tensor([token], dtype=torch.long, device=self._device)
        self.generated = torch.cat([self.generated, new])
        offset = torch.tensor([self._presence + self._frequency], dtype=torch.float32, device=self._device)
        self.offsets = torch.cat([self.offsets, offset])
        if self._seen is not None and token not in self._seen:
            self._seen.add(token)
            self.seen = torch.cat([self.seen, new])


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
    index = (on_device(rows, device), on_device(ids, device))
    logits.index_put_(index, on_device(values, device, logits.dtype), accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, allowed: Sequence[torch.Tensor | None]) -> None:
    """vLLM's ``allowed_token_ids``, in place: every token of a row but its allowed ids (a tensor
    on the logits' device, built once per request; None: every token) is masked (-inf)."""
    rows = [row for row, ids in enumerate(allowed) if ids is not None]
    if not rows:
        return
    keep = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool, device=logits.device)
    for i, row in enumerate(rows):
        keep[i, allowed[row]] = True
    index = on_device(rows, logits.device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def on_device(values: Sequence[int | float], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device``; on CUDA copied from pinned memory, queued behind
    the work in flight instead of waiting for it (``engine.overlap``)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]
) -> None:
    """The repetition penalty, then presence and frequency, in place, on the rows that have a
    history: each a gather and a scatter over the (row, token) pairs concerned, built from the
    histories' tensors, so the cost follows the tokens a request has seen, not the vocabulary."""
    rows = [i for i, h in enumerate(histories) if h is not None]
    repeated = [i for i in rows if histories[i].seen is not None]
    if repeated:
        index, per_pair = _pairs(logits, [histories[i].seen for i in repeated], repeated)
        factor = _per_row(logits, [params[i].repetition_penalty for i in repeated], per_pair)
        values = logits[index]
        logits[index] = torch.where(values > 0, values / factor, values * factor)
    counted = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
    if counted:
        index, _ = _pairs(logits, [histories[i].generated for i in counted], counted)
        offsets = torch.cat([histories[i].offsets for i in counted]).to(logits.dtype)
        logits.index_put_(index, -offsets, accumulate=True)


def _pairs(
    logits: torch.Tensor, ids: list[torch.Tensor], rows: list[int]
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(row index, token index)`` of every (row, id) pair, and the pair count per row."""
    per_row = torch.tensor([len(t) for t in ids], device=logits.device)
    row_index = torch.repeat_interleave(torch.tensor(rows, device=logits.device), per_row)
    return (row_index, torch.cat(ids)), per_row


def _per_row(logits: torch.Tensor, values: list[float], per_row: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=logits.dtype, device=logits.device), per_row)
