"""The paged KV pool: one tensor per device, registered once with the KV transport.

Layout ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``: one
block of one layer's K (or V) is one contiguous byte range, so a request's KV is
``num_layers x 2`` runs of (coalesced) block ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_memory import host_tensor
from engine.kv_layout import KVLayout
from engine.tensor_parallel import Shard


def layout_for(config: object, block_size: int, dtype: torch.dtype, shard: Shard | None = None) -> KVLayout:
    """KV layout of a transformers decoder config; with ``shard``, of that tensor-parallel rank's
    KV heads."""
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=shard.num_kv_heads if shard else getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
    )


@dataclass(frozen=True)
class KVPoolView:
    """What a KV transport needs of a pool: the tensor it registers and addresses, and the
    layout peers must share. Fixed for the pool's life, so readable from any thread."""

    tensor: torch.Tensor
    layout: KVLayout
    num_blocks: int

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def base_address(self) -> int:
        return self.tensor.data_ptr()


class KVPool:
    """Owns the pool tensor; per-layer flat views index it by slot (block * size + offset)."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        dtype = getattr(torch, layout.dtype)
        # zeroed, every page touched up front: the memory cost is visible at start. On CPU
        # the pool sits on 2 MB pages where the kernel allows (other processes copy from and
        # into it over NIXL: see engine/host_memory.py)
        if torch.device(device).type == "cpu":
            self.tensor = host_tensor(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        flat = (num_blocks * layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._k = [self.tensor[i, 0].view(flat) for i in range(layout.num_layers)]
        self._v = [self.tensor[i, 1].view(flat) for i in range(layout.num_layers)]
        self._k_blocks = [self.tensor[i, 0] for i in range(layout.num_layers)]
        self._v_blocks = [self.tensor[i, 1] for i in range(layout.num_layers)]

    def view(self) -> KVPoolView:
        return KVPoolView(tensor=self.tensor, layout=self.layout, num_blocks=self.num_blocks)

    def key_slots(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys as ``[num_slots, num_kv_heads, head_dim]``."""
        return self._k[layer]

    def value_slots(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def key_blocks(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys as ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._k_blocks[layer]

    def value_blocks(self, layer: int) -> torch.Tensor:
        return self._v_blocks[layer]

    def copy_blocks_from(self, other: KVPool, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy a request's blocks from another pool in this process (all layers, K and V)."""
        if other.layout != self.layout:
            raise ValueError(f"KV layout mismatch: {other.layout} != {self.layout}")
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
        src = torch.tensor(src_block_ids, device=other.tensor.device)
        dst = torch.tensor(dst_block_ids, device=self.tensor.device)
        self.tensor[:, :, dst] = other.tensor[:, :, src].to(self.tensor.device)
