"""The KV pool's layout as peers compare it (no torch at import: the settings and the KV handles
that the ingress and the controller load use it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """The shape facts a peer must share before KV bytes can be exchanged."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        import torch

        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size
