"""Asynchronous scheduling: the host prepares decode step n+1 while the GPU runs step n.

A synchronous decode step leaves the GPU idle while the host schedules the next step, copies
its inputs, reads the sampled tokens back and turns them into text and outputs (at batch 64
that host share was a quarter of a graph-replayed step: docs/benchmarks/gpu.md). With
``EngineSettings.async_scheduling`` the engine keeps one step in flight instead::

    step k:   schedule n+1  ->  launch n+1 (its tokens fed from n's, on the device)
              ->  wait for n's tokens (copied to the host behind n)  ->  outputs of n

Step n's tokens are not known on the host when step n+1 is scheduled, so each sampled
sequence holds a *placeholder* (``PLACEHOLDER``) at the end of its token ids until they land;
the runner reads step n+1's input tokens from step n's sampled tensor (``FedTokens``). The
engine keeps a step in flight only while the batch is a steady set of decoding requests whose
sampling needs nothing from the tokens on the host (no penalties, no grammar, no speculation)
and nothing else waits; otherwise it lands the step in flight and runs the next one
synchronously. A request that ends while a step holding it is in flight (its token was a stop,
or it was aborted) gives its blocks back only once that step is done: the GPU may still be
writing its K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

PLACEHOLDER = -1  # a token sampled on the device, not read back yet


@dataclass(frozen=True)
class FedTokens:
    """A step's input tokens taken on the device from the previous step's sampled tokens:
    chunk i's token is ``tokens[rows[i]]`` (every chunk one decode token)."""

    tokens: torch.Tensor
    rows: Sequence[int]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tokens.index_select(0, rows)


@dataclass(eq=False)
class InFlight:
    """A launched step whose sampled tokens the host has not read: ``states[i]`` (the engine's
    per-request state) sampled ``tokens[i]``; ``logits`` kept for the requests' logprobs."""

    states: list
    tokens: torch.Tensor
    logits: torch.Tensor
    started: float
    host: torch.Tensor  # the tokens' copy on the host (pinned on CUDA), filled behind the step
    ready: torch.cuda.Event | None
    free_after: list[int] = field(default_factory=list)  # blocks of requests that ended while it ran

    @classmethod
    def launch(cls, states: list, tokens: torch.Tensor, logits: torch.Tensor, started: float) -> InFlight:
        """Queue the copy of ``tokens`` to the host behind the step (no wait on CUDA)."""
        if tokens.device.type != "cuda":
            return cls(states, tokens, logits, started, tokens.cpu(), None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(states, tokens, logits, started, host, ready)

    @cached_property
    def row_of(self) -> dict[int, int]:
        """Each sampled sequence's row, by ``id`` of its state."""
        return {id(state): row for row, state in enumerate(self.states)}

    def holds(self, state: object) -> bool:
        return any(s is state for s in self.states)

    def wait(self) -> list[int]:
        """The sampled tokens, once the step is done (the copy follows its last kernel)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
