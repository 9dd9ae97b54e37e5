"""Prefix-aware routing: send a prompt where its prefix went before, within a load bound.

Each router (one per deployment handle: the ingress's prefill handle, its decode handle)
remembers, for the hash-chained keys of the prompts it routed (``engine.block_allocator
.hash_blocks`` over ``BLOCK_TOKENS``-token blocks, at most ``MAX_BLOCKS`` of them), which
replica it sent them to. A new prompt whose longest remembered leading key maps to a
replica that can take it goes there: that replica's prefix cache most likely still holds
those blocks (turn 2 of a conversation carries turn 1's prompt as its prefix). The bound is
consistent hashing with bounded loads' (Mirrokni et al.): a replica takes an affine request
only while its load (running + waiting) stays within ``LOAD_FACTOR`` x the mean load + 1, so
one hot prefix spreads over several replicas instead of overloading one. A prompt with no
remembered prefix routes as before (least loaded first), and is remembered where it went.

Why remembering and not replicas reporting their cached keys: the router already decides
every placement, so its memory is exact about where a prefix went, costs no report traffic
and no per-replica key sets on the wire; what it cannot see (an eviction on the replica)
costs one cache miss, never a wrong answer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.block_allocator import hash_blocks

BLOCK_TOKENS = 16
MAX_BLOCKS = 256  # keys remembered per prompt: its first 4,096 tokens
MAX_KEYS = 200_000  # keys remembered in all (least recently used dropped first)
LOAD_FACTOR = 1.25


def prompt_keys(prompt_token_ids: Sequence[int]) -> list[bytes]:
    return hash_blocks(prompt_token_ids[: BLOCK_TOKENS * MAX_BLOCKS], BLOCK_TOKENS)


def load_bound(loads: Sequence[int]) -> int:
    """The most requests a replica may hold to take one more affine request."""
    return math.ceil(LOAD_FACTOR * (sum(loads) + 1) / max(len(loads), 1))


class PrefixAffinity:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._replica_of: OrderedDict[bytes, Any] = OrderedDict()
        self.max_keys = max_keys
        self.hits = 0  # requests placed by their prefix

    def preferred(self, keys: Sequence[bytes], loads: dict[Any, int]) -> Any | None:
        """The replica (among ``loads``' keys: replica id -> running + waiting) that got the
        longest leading run of ``keys``, if it is within the load bound."""
        bound = load_bound(list(loads.values()))
        for key in reversed(keys):
            replica = self._replica_of.get(key)
            if replica is None:
                continue
            if replica in loads and loads[replica] < bound:
                self.hits += 1
                return replica
            return None  # gone or too busy: route by load (and remember the new place)
        return None

    def remember(self, keys: Sequence[bytes], replica: Any) -> None:
        for key in keys:
            self._replica_of[key] = replica
            self._replica_of.move_to_end(key)
        while len(self._replica_of) > self.max_keys:
            self._replica_of.popitem(last=False)
