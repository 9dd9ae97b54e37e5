import gc
from pathlib import Path

import pytest
import torch

from engine.host_memory import HUGE_PAGE_BYTES, host_tensor, huge_page_bytes
from engine.kv_pool import KVLayout, KVPool


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def test_host_tensor_is_zeroed_contiguous_aligned_and_writable():
    t = host_tensor((3, 5, 1 << 18), torch.float32)
    assert t.shape == (3, 5, 1 << 18) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(torch.count_nonzero(t)) == 0
    t[2, 4, -1] = 7.0
    view = t[2, 4]
    del t
    gc.collect()
    # the mapping outlives the name: views still read the bytes written
    assert float(view[-1]) == 7.0 and float(view.sum()) == 7.0


def test_small_tensors_use_torch_memory():
    small = host_tensor((1000,), torch.float16)
    assert small.dtype == torch.float16 and small.shape == (1000,) and int(torch.count_nonzero(small)) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off on this kernel")
def test_opting_out_keeps_ordinary_pages():
    plain = host_tensor((3 << 20,), torch.float32, huge_pages=False)  # 12 MB
    assert plain.shape == (3 << 20,) and int(torch.count_nonzero(plain)) == 0
    assert huge_page_bytes(plain) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off on this kernel")
def test_kv_pool_sits_on_huge_pages_where_the_kernel_allows():
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
    pool = KVPool(layout, num_blocks=128)  # 2 x 2 x 128 x 16 x 3 x 64 x 4 B = 6 MB
    assert pool.tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    # at least the whole 2 MB pages inside the tensor (the kernel may fall back per page
    # under memory fragmentation, but not for all of a fresh 6 MB mapping)
    assert huge_page_bytes(pool.tensor) >= HUGE_PAGE_BYTES
    assert pool.key_slots(1).shape == (128 * 16, 3, 64)
