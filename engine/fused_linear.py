"""Sibling projections as one matrix product, inside the model's own modules.

A batch-1 decode step is a chain of matrix-vector products whose speed is the speed at
which the weights stream from memory, and small matrices stream slower than big ones
(see ``engine/weights.py``). Attention's q/k/v projections and the MLP's gate/up
projections read the same input, so each group can be one product over the concatenated
weights: 4 products per layer instead of 7, each over a bigger matrix.

The modules' code is untouched. The group's first projection (``q_proj``, ``gate_proj``)
becomes a ``FusedLinear`` that computes the whole group's output and keeps it; the others
(``k_proj``, ``v_proj``, ``up_proj``) become ``FusedSlice`` modules that return their
columns of it when called on the same input tensor, the order every supported family's
forward calls them in. Called on any other input (another model's code, a hook), a slice
computes its own product from its view of the fused weight, so the result is always right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_matmul

# (first projection, the others) of each group, by attribute name on the parent module
GROUPS = (("q_proj", ("k_proj", "v_proj")), ("gate_proj", ("up_proj",)))


class _Shared:
    """The group's last input and output (one step's worth; dropped when the group is done)."""

    __slots__ = ("input", "output", "pending")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.pending = 0


class FusedLinear(nn.Module):
    """The group's first projection: one product for the group, its own columns returned."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None, width: int, shared: _Shared, others: int):
        super().__init__()
        # [in, sum(out)]: the fused weight, column-major (contiguous) on CPU, a view of the
        # row-major [sum(out), in] on CUDA (cuBLAS's usual layout for nn.Linear)
        self.register_buffer("weight_t", weight_t, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.in_features, self.out_features = weight_t.shape[0], width
        self._shared = shared
        self._others = others
        self.packed_weight: torch.Tensor | None = None  # cpu_matmul.pack of the fused weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fused(x)
        self._shared.input, self._shared.output, self._shared.pending = x, out, self._others
        return out[..., : self.out_features]

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's output (its projections' columns side by side), kept nowhere."""
        w_t = self.weight_t
        return cpu_matmul.linear(x, w_t.t(), w_t, self.bias, self.packed_weight).view(*x.shape[:-1], -1)


class FusedSlice(nn.Module):
    """Another projection of the group: columns ``[start, start + width)`` of the fused output."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None, start: int, width: int, shared: _Shared):
        super().__init__()
        # views of the fused tensors: no bytes copied
        self.register_buffer("weight_t", weight_t[:, start : start + width], persistent=False)
        self.register_buffer("bias", None if bias is None else bias[start : start + width], persistent=False)
        self.start = start
        self.in_features, self.out_features = weight_t.shape[0], width
        self._shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self._shared
        if x is shared.input and shared.output is not None:
            out = shared.output[..., self.start : self.start + self.out_features]
            shared.pending -= 1
            if shared.pending <= 0:
                shared.input = shared.output = None
            return out
        return F.linear(x, self.weight_t.t(), self.bias)


def _fuse_group(parent: nn.Module, first: str, others: tuple[str, ...], column_major: bool) -> bool:
    names = (first, *others)
    linears = [getattr(parent, n, None) for n in names]
    if not all(isinstance(m, nn.Linear) for m in linears):
        return False
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        return False
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])  # [sum(out), in]
        weight_t = weight.t().contiguous() if column_major else weight.t()
        bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears]).contiguous()
    shared = _Shared()
    setattr(parent, first, FusedLinear(weight_t, bias, linears[0].out_features, shared, len(others)))
    start = linears[0].out_features
    for name, module in zip(others, linears[1:]):
        setattr(parent, name, FusedSlice(weight_t, bias, start, module.out_features, shared))
        start += module.out_features
    return True


def fuse_projections(model: nn.Module, column_major: bool = True) -> int:
    """Fuse every q/k/v and gate/up group found in ``model``; returns the number fused.
    ``column_major``: the fused weight laid out ``[in, out]`` (CPU's fast one-row layout);
    False keeps nn.Linear's ``[out, in]`` rows (CUDA)."""
    fused = 0
    for module in list(model.modules()):
        for first, others in GROUPS:
            fused += _fuse_group(module, first, others, column_major)
    return fused
