"""Speculative decoding by prompt lookup (n-gram), on the decode side. No model, no torch.

Before a step, each decoding request whose recent proposals paid off gets up to k proposed
tokens: the tokens that followed the latest earlier occurrence of its last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``), searched in its prompt and output. The
scheduler runs them after the request's last token in the same chunk, one forward computes
logits at every position, and the engine accepts proposals left to right while each equals
the token it samples there (``engine.sampling.verify_token``: exact for greedy and for
sampling); the first mismatch is replaced by the sampled token, and the KV written for the
rejected proposals is given back (the sequence keeps the blocks its accepted tokens need).

Adaptive (``SpecState``): a request whose last ``WINDOW`` verified steps accepted under
``MIN_ACCEPTED_RATE`` of what they proposed pauses for ``PAUSE_STEPS`` steps, doubling each time
it pauses again (text that does not copy its context stops paying for verification), and a step
with more running requests than ``disable_by_batch_size`` proposes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

WINDOW = 4  # verified steps judged together
MIN_ACCEPTED_RATE = 0.3  # accepted / proposed below which a request pauses
PAUSE_STEPS = 8  # first pause, in steps; doubled per pause up to MAX_PAUSE_STEPS
MAX_PAUSE_STEPS = 256


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of
    ``tokens``, for the largest n in ``[min_n, max_n]`` that occurs; () if none does."""
    length = len(tokens)
    if k < 1 or length <= min_n:
        return ()
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # every window that starts before the suffix itself (its continuation is known)
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)
        hits = np.flatnonzero((windows == array[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(int(t) for t in array[start : start + k])
    return ()


@dataclass
class SpecState:
    """One request's recent acceptance and its pause."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (proposed, accepted)
    paused_until: int = 0  # engine step before which it proposes nothing
    pause: int = PAUSE_STEPS

    def may_propose(self, step: int) -> bool:
        return step >= self.paused_until

    def record(self, proposed: int, accepted: int, step: int) -> None:
        """Count one verified step; pause when the window's acceptance is low."""
        self.recent.append((proposed, accepted))
        if len(self.recent) < WINDOW:
            return
        total = sum(p for p, _ in self.recent)
        if sum(a for _, a in self.recent) < MIN_ACCEPTED_RATE * total:
            self.paused_until = step + self.pause
            self.pause = min(self.pause * 2, MAX_PAUSE_STEPS)
            self.recent.clear()


@dataclass
class SpecCounters:
    """Since start, with vLLM's meaning: verified steps that carried proposals (``drafts``),
    tokens proposed, tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
