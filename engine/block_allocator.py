"""Pure-Python block allocator for the paged KV pool, with automatic prefix caching.

No torch, no Ray: a free list, per-block reference counts and, with caching on, a map from
block hash to block.

**Prefix caching.** A full block's key (``hash_blocks``) covers its tokens and every token
before it (a hash chain), so equal keys mean equal KV. A computed full block is
``register``-ed under its key; a later sequence whose leading blocks have the same keys
shares those blocks (``match_prefix`` then ``share``: one more reference each) instead of
recomputing them. A block whose last holder frees it keeps its KV and its key and becomes
**evictable**: it still counts as free (``num_free_blocks`` means "allocatable now"), and
``allocate`` takes truly free blocks first, then evicts the least recently freed cached
blocks (dropping their keys). A shared block is never written: a sequence writes KV only at
positions past its shared prefix, which is whole blocks.

Invariants (checked by the tests after every scenario, and by ``check``):
  * a block is in the free list  <=>  its ref count is 0 and it has no key;
  * a block is evictable         <=>  its ref count is 0 and it has a key;
  * ``len(free list) + num_cached_blocks + #{blocks with ref > 0} == num_blocks``, and
    ``num_free_blocks == len(free list) + num_cached_blocks``;
  * every key maps to exactly one block, and that block carries that key.

Allocation order is deterministic: the free list starts as ``0..num_blocks-1``;
``allocate`` takes from the head and ``free`` appends released blocks (without a key) to
the tail in the order given, so tests can assert exact block ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

HASH_BYTES = 16  # blake2b digest: collisions are not a practical concern at 128 bits


class BlockAllocatorError(RuntimeError):
    """Raised on a misuse of the allocator (double free, allocating too many)."""


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of ``token_ids``: each covers its block's tokens and, through
    ``parent`` (the previous block's key), every token before it. Deterministic across
    processes (prefill and decode replicas compute the same keys)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=HASH_BYTES).digest()
        keys.append(parent)
    return keys


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable blocks that keep a cached prefix's KV (ref count 0, counted as free)."""
        return len(self._evictable)

    @property
    def num_uncached_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (ref count 1): free ones first, then evict the least
        recently freed cached ones."""
        if not self.can_allocate(num_blocks):
            raise BlockAllocatorError(
                f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} of {self.num_blocks} free"
            )
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._by_key[self._key_of[block_id]]
                self._key_of[block_id] = None
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks that are already allocated (pinning)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise BlockAllocatorError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block whose count reaches 0 goes to the free
        list's tail, or, holding a cached prefix, becomes evictable (most recent last)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise BlockAllocatorError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if self._key_of[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---- prefix caching -------------------------------------------------------------

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of ``keys`` (no reference taken)."""
        if not self.enable_caching:
            return []
        blocks = []
        for key in keys:
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def share(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks from ``match_prefix`` (an evictable one is
        taken back from the evictable set)."""
        for block_id in block_ids:
            if self._key_of[block_id] is None:
                raise BlockAllocatorError(f"share of block {block_id}, which holds no cached prefix")
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def register(self, block_id: int, key: bytes) -> bool:
        """Record that allocated ``block_id`` holds the full block ``key``; False when caching
        is off, the block already has a key, or another block holds that key (it stays the one)."""
        if not self.enable_caching or self._key_of[block_id] is not None or key in self._by_key:
            return False
        if self._ref_counts[block_id] == 0:
            raise BlockAllocatorError(f"register of free block {block_id}")
        self._key_of[block_id] = key
        self._by_key[key] = block_id
        return True

    def key_of(self, block_id: int) -> bytes | None:
        return self._key_of[block_id]

    def references(self) -> list[int]:
        """Each block's reference count (a copy: for accounting checks)."""
        return list(self._ref_counts)

    def check(self) -> None:
        """Assert the invariants above (tests, ``GET /admin/kv``-style checks)."""
        in_use = sum(count > 0 for count in self._ref_counts)
        if len(self._free) + len(self._evictable) + in_use != self.num_blocks:
            raise BlockAllocatorError(
                f"accounting: {len(self._free)} free + {len(self._evictable)} cached + {in_use} in use"
                f" != {self.num_blocks}"
            )
        for block_id in self._free:
            if self._ref_counts[block_id] or self._key_of[block_id] is not None:
                raise BlockAllocatorError(f"free block {block_id} is held or keyed")
        for block_id in self._evictable:
            if self._ref_counts[block_id] or self._key_of[block_id] is None:
                raise BlockAllocatorError(f"evictable block {block_id} is held or has no key")
        for key, block_id in self._by_key.items():
            if self._key_of[block_id] != key:
                raise BlockAllocatorError(f"key map and block {block_id} disagree")
