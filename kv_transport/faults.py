"""Fault points for tests and failure rehearsals; all off by default.

Named points: ``export``, ``fetch`` (consumer, before the READ is posted),
``push_layer`` (producer, per layer), ``finish_push`` (producer, before the completion
notice). ``delay_s[point]`` sleeps there, ``fail`` raises ``KVTransferError`` there, and
``drop_release`` leaves out the consumer's release notice, so the producer frees the
blocks only when ``kv_transfer_timeout_s`` runs out.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kv_transport.base import KVTransferError

POINTS = ("export", "fetch", "push_layer", "finish_push")


@dataclass(frozen=True)
class FaultPoints:
    delay_s: dict[str, float] = field(default_factory=dict)
    fail: frozenset[str] = frozenset()
    drop_release: bool = False

    def __post_init__(self) -> None:
        unknown = (set(self.delay_s) | set(self.fail)) - set(POINTS)
        if unknown:
            raise ValueError(f"unknown fault points {sorted(unknown)}; known: {POINTS}")

    def hit(self, point: str, request_id: str, peer: str) -> None:
        """Apply the fault at ``point`` (blocking sleep; for the engine thread)."""
        if point in self.delay_s:
            time.sleep(self.delay_s[point])
        self._maybe_fail(point, request_id, peer)

    async def hit_async(self, point: str, request_id: str, peer: str) -> None:
        if point in self.delay_s:
            await asyncio.sleep(self.delay_s[point])
        self._maybe_fail(point, request_id, peer)

    def _maybe_fail(self, point: str, request_id: str, peer: str) -> None:
        if point in self.fail:
            raise KVTransferError(f"injected failure at {point}", request_id, peer)


NO_FAULTS = FaultPoints()
