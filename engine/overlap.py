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
and no waiting request could be admitted (none waits, or ``max_num_seqs`` run); otherwise it
lands the step in flight and runs the next one synchronously. Nothing the host does after a
launch waits for the device: index tensors are copied from pinned memory, sampling draws without
reading the probabilities back, and the requested log-probabilities come back with the tokens.
A request that ends while a step holding it is in flight (its token was a stop, or it was
aborted) gives its blocks back only once that step is done: the GPU may still write its K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.params import TokenLogprobs

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
    per-request state) sampled ``tokens[i]``. What the host reads back, the tokens and the
    log-probabilities that requests asked for (``engine.sampling.batch_logprobs``), is copied
    to pinned host memory behind the step; ``ready`` is recorded after those copies."""

    states: list
    tokens: torch.Tensor
    started: float
    host: list[torch.Tensor]  # tokens; then, with logprobs, the token's, the top ids and values
    ready: torch.cuda.Event | None
    free_after: list[int] = field(default_factory=list)  # blocks of requests that ended while it ran

    @classmethod
    def launch(cls, states: list, tokens: torch.Tensor, logprobs: Sequence[torch.Tensor], started: float) -> InFlight:
        """Queue the copies to the host behind the step (no wait on CUDA)."""
        if tokens.device.type != "cuda":
            return cls(states, tokens, started, [t.cpu() for t in (tokens, *logprobs)], None)
        host = []
        for tensor in (tokens, *logprobs):
            host.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
            host[-1].copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))
        return cls(states, tokens, started, host, ready)

    @cached_property
    def row_of(self) -> dict[int, int]:
        """Each sampled sequence's row, by ``id`` of its state."""
        return {id(state): row for row, state in enumerate(self.states)}

    def holds(self, state: object) -> bool:
        return id(state) in self.row_of

    def wait(self) -> tuple[list[int], Callable[[int, int], TokenLogprobs] | None]:
        """The sampled tokens, and a function giving row i's ``TokenLogprobs`` with its top n
        (None without logprobs), once the step and its copies are done."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist()
        if len(self.host) == 1:
            return tokens, None
        chosen, top_ids, top_values = (t.tolist() for t in self.host[1:])

        def logprobs(row: int, num_top: int) -> TokenLogprobs:
            top = tuple(zip(top_ids[row][:num_top], top_values[row][:num_top]))
            return TokenLogprobs(token_id=tokens[row], logprob=chosen[row], top=top)

        return tokens, logprobs
