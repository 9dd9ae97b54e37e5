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

oneDNN is faster again on its own blocked copy of the weights (``pack``), which the
engine keeps beside the column-major bytes when ``EngineConfig.cpu_packed_weights`` is on
(the default): the weights' memory once more, for (same machine and method, final code,
``cpu_packed_weights`` off -> on)

    decode step, sequences:  1: 42.8 -> 43.3   2: 64.0 -> 47.9   4: 69.7 -> 47.1 ms
                             8: 86.2 -> 62.7  16: 141.5 -> 95.1  32: 216.8 -> 188.7 ms
    2,048-token prefill      6.73 -> 6.67 s

oneDNN's kernel for exactly two rows streams the weights slowly here (the LM head: 8.0 ms
for 2 rows, 5.5 ms for 3), so a 2-row product runs as 3 rows, the third zero: a 2-sequence
decode step 62.4 -> 48.2 ms, same tokens.

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
