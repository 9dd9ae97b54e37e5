"""What Ray carries about KV: small, versioned handles (never the bytes themselves).

``KVHandle`` (pull): the producer's engine id and incarnation, where the prompt's KV sits
(block ranges), the token count, the first token, the pool's ``engine.kv_pool.KVLayout``
(which must match exactly on both sides) and an expiry.
``KVDestination`` (push): the same for blocks a consumer reserved for incoming KV.
Block ids travel as ``(start, count)`` ranges: a fresh request's blocks are mostly
contiguous, so a 4,096-token request is a few ranges, not 256 numbers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field

from engine.kv_layout import KVLayout

HANDLE_VERSION = 1


class BlockOwner(Protocol):
    """The engine side that describes its blocks (a transport): who it is and its pool's layout."""

    engine_id: str
    incarnation: str
    layout: KVLayout


def to_ranges(block_ids: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``[4, 5, 6, 9, 10]`` -> ``((4, 3), (9, 2))``: (first block, count) runs, in order."""
    ranges: list[list[int]] = []
    for block in block_ids:
        if ranges and ranges[-1][0] + ranges[-1][1] == block:
            ranges[-1][1] += 1
        else:
            ranges.append([block, 1])
    return tuple((start, count) for start, count in ranges)


def from_ranges(ranges: Sequence[tuple[int, int]]) -> list[int]:
    return [start + i for start, count in ranges for i in range(count)]


class RankPeer(BaseModel):
    """One tensor-parallel rank of an engine: its NIXL agent's entry in the peer registry and
    the KV heads its pool holds."""

    model_config = ConfigDict(frozen=True)

    engine_id: str
    incarnation: str
    kv_head_start: int = Field(ge=0)
    num_kv_heads: int = Field(ge=1)

    @classmethod
    def whole(cls, owner: BlockOwner) -> RankPeer:
        """A one-rank engine as a rank: it holds every KV head of its pool."""
        heads = owner.layout.num_kv_heads
        return cls(engine_id=owner.engine_id, incarnation=owner.incarnation, kv_head_start=0, num_kv_heads=heads)


class _BlocksOf(BaseModel):
    model_config = ConfigDict(frozen=True)

    version: Literal[1] = Field(default=HANDLE_VERSION, description="schema version of this handle")
    request_id: str = Field(description="globally unique request id")
    engine_id: str = Field(description="engine that owns the blocks")
    incarnation: str = Field(description="start of that engine (a restarted engine has a new one)")
    block_ranges: tuple[tuple[int, int], ...] = Field(description="(first block, count) runs of the blocks")
    num_tokens: int = Field(description="tokens of KV the blocks hold (the prompt)")
    layout: KVLayout = Field(description="layout of the owner's pool (must equal the peer's)")
    expires_at: float = Field(description="unix time after which the owner frees the blocks")
    ranks: tuple[RankPeer, ...] = Field((), description="a tensor-parallel owner's ranks, by rank; () for one")

    @classmethod
    def of_blocks(
        cls,
        owner: BlockOwner,
        request_id: str,
        block_ids: Iterable[int],
        num_tokens: int,
        expires_at: float,
        **fields: Any,
    ) -> Self:
        """Describe ``owner``'s blocks of one request; ``fields``: those of the subclass."""
        return cls(
            request_id=request_id,
            engine_id=owner.engine_id,
            incarnation=owner.incarnation,
            block_ranges=to_ranges(block_ids),
            num_tokens=num_tokens,
            layout=owner.layout,
            expires_at=expires_at,
            **fields,
        )

    @property
    def block_ids(self) -> list[int]:
        return from_ranges(self.block_ranges)

    def seconds_left(self) -> float:
        return self.expires_at - time.time()

    def peers(self) -> tuple[RankPeer, ...]:
        """The owner's ranks; one that holds every KV head when the owner has one rank."""
        return self.ranks or (RankPeer.whole(self),)

    def split_otherwise(self, layout: KVLayout) -> bool:
        """Whether KV moves head by head between the owner and a pool of ``layout`` (one rank
        of the other side): either side is split over ranks, or their KV heads differ."""
        return bool(self.ranks) or self.layout.num_kv_heads != layout.num_kv_heads


class KVHandle(_BlocksOf):
    """Pull: prefill's pinned blocks, readable by the consumer until ``expires_at``. A
    tensor-parallel producer names each rank (``ranks``; its ``layout`` is one rank's): every
    rank holds the same block ids, each with its own KV heads."""

    first_token: int = Field(description="token sampled by prefill")


class KVDestination(_BlocksOf):
    """Push: blocks the consumer reserved; the producer writes the KV into them, except the
    first ``skip_blocks``, which the consumer's prefix cache already holds. A tensor-parallel
    consumer names each rank (``ranks``), as a handle does."""

    skip_blocks: int = Field(0, ge=0, description="leading blocks that hold their KV already (not written)")
