"""The product ``x @ W.T (+ bias)`` on CPU, by the library that is fastest for its row count.

PyTorch sends a float32 ``x @ W_t`` to MKL. For one row (batch-1 decode, a matrix-vector
product bound by memory bandwidth) MKL on the column-major weights of ``engine/weights.py``
is the fastest call here. For a few rows it is not: MKL's skinny products read the weights
far slower, so a small batch's decode step costs much more than one sequence's, while
oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op TorchInductor's CPU backend
emits) on the same bytes, in the same layout, does much better from 2 rows up.

oneDNN is faster again on its own blocked copy of the weights (``pack``), which the
engine keeps beside the column-major bytes when ``EngineConfig.cpu_packed_weights`` is on
(the default), at the cost of the weights' memory once more. oneDNN's kernel for exactly
two rows streams the weights slowly, so a 2-row product runs as 3 rows, the third zero.
The figures: ``docs/benchmarks/cpu_kernels.md``.

All of this is float32, the CPU default. Other dtypes (bfloat16, float16) keep
``torch.matmul`` for every product: oneDNN's low-precision paths need CPU features
(``avx512_fp16`` for float16) that PyTorch checks for itself on its own calls, and they
were not measured here. Where oneDNN is not built in, every product goes to
``torch.matmul`` too.
"""

from __future__ import annotations

import torch

_ONEDNN = torch.backends.mkldnn.is_available()
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if _ONEDNN else None
_ONEDNN_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _ONEDNN else None
PACK_ROWS = 32  # the row count oneDNN picks its blocked layout for
MIN_ONEDNN_ROWS = 3  # fewer rows (but more than one) are padded with zero rows to this


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 CPU ``weight`` ``[out, in]`` for ``linear``'s
    products of several rows; None for other dtypes or devices, or without oneDNN."""
    if _ONEDNN_LINEAR is None or _ONEDNN_PACK is None or not weight.is_cpu or weight.dtype != torch.float32:
        return None
    return _ONEDNN_PACK(weight.detach().contiguous(), PACK_ROWS)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``weight`` ``[out, in]`` (any strides) and ``weight_t`` its
    transpose ``[in, out]``: MKL on ``weight_t`` for one row; oneDNN for more, on ``packed``
    (from ``pack(weight)``) if given, else on ``weight`` itself."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if _ONEDNN_LINEAR is not None and rows > 1 and x.is_cpu and x.dtype == torch.float32:
        w = weight if packed is None else packed
        if rows >= MIN_ONEDNN_ROWS:
            return _ONEDNN_LINEAR(x, w, bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(MIN_ONEDNN_ROWS - rows, flat.shape[1])])
        return _ONEDNN_LINEAR(flat, w, bias, "none", [], "")[:rows].view(*x.shape[:-1], -1)
    out = x @ weight_t
    return out if bias is None else out + bias
