"""The product ``x @ W.T (+ bias)`` on CPU, by the library that is fastest for its row count.

PyTorch sends a float32 ``x @ W_t`` to MKL. For one row (batch-1 decode, a matrix-vector
product bound by memory bandwidth) MKL on the column-major weights of ``engine/weights.py``
is the fastest call here. For a few rows it is not: MKL's skinny products read the weights
far slower, so a decode step of 4 sequences cost 2.2x the step of one. oneDNN's matmul
(``torch.ops.mkldnn._linear_pointwise``, the op TorchInductor's CPU backend emits) on the
same bytes, in the same layout, does much better from 2 rows up. Measured on the 2-core dev
machine, 1 thread, default model, one process alternating both forms (same tokens):

    decode step, 4 sequences      94.9 -> 72.7 ms
    decode step, 32 sequences    216.6 -> 185.0 ms
    2,048-token prefill           6.95 -> 6.6 s
    decode step, 1 sequence       42.2 -> 42.6 ms (MKL kept)

Where oneDNN is not built in, every product goes to ``torch.matmul``.
"""

from __future__ import annotations

import torch

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def linear(x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``weight`` ``[out, in]`` (any strides) and ``weight_t`` its
    transpose ``[in, out]``: MKL on ``weight_t`` for one row, oneDNN on ``weight`` for more."""
    if _ONEDNN_LINEAR is not None and x.numel() > x.shape[-1] and x.is_cpu:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    out = x @ weight_t
    return out if bias is None else out + bias
