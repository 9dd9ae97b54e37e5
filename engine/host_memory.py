"""Large CPU tensors in memory the kernel may back with 2 MB pages.

The KV pool is read and written by other processes (NIXL over UCX copies it between
processes on CPU memory), and every 4 KB page of a transfer costs the kernel a page-table
walk and a pin, so a READ from huge pages is markedly faster (the figures:
``docs/benchmarks/kv_transfer_probes.md``, and the "raw NIXL, 4 KB pages" column of
``docs/benchmarks/kv_transfer.md``). PyTorch's CPU allocator does the same only when
``THP_MEM_ALLOC_ENABLE`` is set before its first allocation in the process, which a
library cannot rely on, so the pool maps its own memory: anonymous, 2 MB-aligned,
``MADV_HUGEPAGE``, zero-filled and touched up front.

Where the kernel has transparent huge pages off (``never``) or no ``MADV_HUGEPAGE``, the
same tensor comes back on ordinary pages. ``huge_pages=False`` asks for ordinary pages
(``MADV_NOHUGEPAGE``) even where the kernel would otherwise use huge ones (``always``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``shape`` on 2 MB-aligned memory madvised for huge
    pages (``huge_pages``) or against them.

    Every page is touched (written) before return, so the memory is resident and its cost
    is visible at start. The mapping lives as long as the tensor (and its views) do.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # one extra huge page of slack to start the tensor on a 2 MB boundary
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_NOHUGEPAGE
    try:
        region.madvise(advice)
    except OSError as exc:  # e.g. a kernel built without transparent huge pages
        logger.info("madvise(%s) refused (%s); ordinary pages", "huge" if huge_pages else "no huge", exc)
    base = torch.frombuffer(region, dtype=torch.uint8, count=HUGE_PAGE_BYTES)
    offset = -base.data_ptr() % HUGE_PAGE_BYTES
    del base
    # frombuffer keeps ``region`` alive for as long as the tensor exists
    tensor = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    tensor.zero_()  # fault every page in now (the mapping reads as zeros already)
    return tensor


def huge_page_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes on huge pages (``AnonHugePages``) in the mappings that overlap ``tensor``'s range
    (Linux; None where ``/proc`` cannot be read)."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    try:
        with open(f"/proc/{os.getpid()}/smaps") as smaps:
            lines = smaps.read().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low < end and high > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
