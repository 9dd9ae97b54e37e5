import pytest

from engine.block_allocator import BlockAllocator, BlockAllocatorError


def test_allocates_from_the_head_and_frees_to_the_tail():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(3) == [2, 3, 4]
    assert alloc.num_free_blocks == 1
    alloc.free([1, 0])
    assert alloc.allocate(3) == [5, 1, 0]
    assert alloc.num_free_blocks == 0
    alloc.free([2, 3, 4, 5, 1, 0])
    assert alloc.num_free_blocks == 6


def test_can_allocate_and_refusal():
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    assert alloc.can_allocate(4) and not alloc.can_allocate(5)
    assert alloc.can_allocate(0) and not alloc.can_allocate(-1)
    held = alloc.allocate(3)
    with pytest.raises(BlockAllocatorError, match="cannot allocate 2 blocks: 1 of 4 free"):
        alloc.allocate(2)
    alloc.free(held)
    assert alloc.num_free_blocks == 4


def test_ref_counts_keep_shared_blocks_until_last_holder():
    alloc = BlockAllocator(num_blocks=5, block_size=2)
    blocks = alloc.allocate(2)
    alloc.incref(blocks)
    assert [alloc.ref_count(b) for b in blocks] == [2, 2]
    alloc.free(blocks)
    assert alloc.num_free_blocks == 3
    alloc.free(blocks)
    assert alloc.num_free_blocks == 5
    assert [alloc.ref_count(b) for b in range(5)] == [0] * 5


def test_double_free_and_incref_of_free_block_are_errors():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    (block,) = alloc.allocate(1)
    alloc.free([block])
    with pytest.raises(BlockAllocatorError, match="double free of block 0"):
        alloc.free([block])
    with pytest.raises(BlockAllocatorError, match="incref of free block 0"):
        alloc.incref([block])
    assert alloc.num_free_blocks == 4


def test_blocks_needed_rounds_up():
    alloc = BlockAllocator(num_blocks=8, block_size=16)
    assert [alloc.blocks_needed(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocator_has_no_torch_import():
    import ast
    import inspect

    import engine.block_allocator as module
    import engine.scheduler as scheduler

    for mod in (module, scheduler):
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(name and name.split(".")[0] in {"torch", "ray"} for name in names), names
