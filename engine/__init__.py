"""The inference engine: paged KV pool, scheduler, model runner (see docs/architecture.md).

Importing it bounds two caches of PyTorch's CPU kernels (unless the environment sets them):
oneDNN keeps one compiled primitive per new product shape (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
default 1,024) and ideep, PyTorch's oneDNN layer, one prepared computation per shape
(``LRU_CACHE_CAPACITY``, default 1,024). A served engine meets a new shape with every new
prompt length, so with the defaults a replica's memory grows for hundreds of lengths; at 64
entries each it levels off after a few dozen at the same speed (the figures:
``python -m bench.kernel_caches``, docs/reliability.md). Both are read at the first oneDNN
call, which comes after this import in every replica.
"""

from __future__ import annotations

import os

KERNEL_CACHE_ENTRIES = "64"

for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_name, KERNEL_CACHE_ENTRIES)
