"""Pure-Python block allocator for the paged KV pool.

No torch, no Ray: a free list and per-block reference counts, nothing else.

Invariants (checked by the tests after every scenario):
  * a block is in the free list  <=>  its ref count is 0;
  * ``num_free_blocks + #{blocks with ref > 0} == num_blocks``.

Allocation order is deterministic: the free list starts as ``0..num_blocks-1``;
``allocate`` takes from the head and ``free`` appends released blocks to the tail
in the order given, so tests can assert exact block ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockAllocatorError(RuntimeError):
    """Raised on a misuse of the allocator (double free, allocating too many)."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free list (ref count 1)."""
        if not self.can_allocate(num_blocks):
            raise BlockAllocatorError(
                f"cannot allocate {num_blocks} blocks: {len(self._free)} of {self.num_blocks} free"
            )
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks that are already allocated (shared prefix, pinning)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise BlockAllocatorError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; blocks whose count reaches 0 go to the tail."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise BlockAllocatorError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
