"""Weight layout for fast batch-1 decode.

A decode step is a chain of matrix-vector products, so its speed is the speed at which
the weights stream from memory. On CPU that speed depends on the weight's memory layout,
its shape and the call: of this model's shapes, those with ``out_features >= in_features``
stream faster column-major (and faster again through ``x @ W_t`` than ``F.linear``), the
others row-major, and a layer's products run faster as 4 fused ones
(``engine/fused_linear.py``) than as the 7 separate ones. The figures:
``docs/benchmarks/cpu_kernels.md``.

So, on CPU: sibling projections are fused; the other matrices with ``out_features >=
in_features`` are stored column-major (the parameter becomes a transposed view of a
contiguous ``[in, out]`` tensor) and multiplied as ``x @ W_t``; the rest stay row-major.
All this is about one-row products: products of two rows or more go to oneDNN, on its own
packed copy of the weights where the engine keeps one, else on the same bytes
(``engine/cpu_matmul.py``). The modules' code is untouched, only the bytes and the
product call change. A tied LM head gets its own copy so the embedding lookup keeps its
row-major table.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine import cpu_matmul
from engine.fused_linear import FusedLinear, fuse_projections


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # for a column-major weight, .t() is the contiguous [in, out] tensor behind the view
    return cpu_matmul.linear(x, self.weight, self.weight.t(), self.bias, getattr(self, "packed_weight", None))


def optimize_cpu_layout(model: PreTrainedModel, packed_weights: bool = False) -> int:
    """Fuse sibling projections and re-lay out the other linear weights for matrix-vector
    speed; with ``packed_weights``, also keep oneDNN's blocked copy of every product's
    weight for products of several rows (``engine/cpu_matmul.py``). Returns the number of
    modules changed. Idempotent."""
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    changed = fuse_projections(model)
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                if module.out_features >= module.in_features:
                    module.weight.data = module.weight.data.t().contiguous().t()
                module.forward = types.MethodType(_linear_forward, module)
                changed += 1
                if packed_weights and getattr(module, "packed_weight", None) is None:
                    module.packed_weight = cpu_matmul.pack(module.weight)
            elif packed_weights and isinstance(module, FusedLinear) and module.packed_weight is None:
                module.packed_weight = cpu_matmul.pack(module.weight_t.t())
    return changed


# RMSNorms computed as ``weight * normalize(x in float32).to(x's dtype)`` (their forward, read)
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Those modules' arithmetic: normalized over the last dimension in float32, rounded to
    ``x``'s dtype, then times ``weight`` (which broadcasts)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rms_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


def optimize_cuda_layout(model: PreTrainedModel) -> int:
    """Fewer kernels per decoder layer on a GPU, where a decode step replayed from a CUDA
    graph runs one small kernel after another: the sibling projections fused (4 products
    instead of 7, weights kept row-major) and each RMSNorm as PyTorch's fused ``rms_norm``
    (the same arithmetic in float32). Returns the number of modules changed. The figures:
    docs/benchmarks/gpu.md."""
    changed = fuse_projections(model, column_major=False)
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
            changed += 1
    return changed


def packed_bytes(model: PreTrainedModel) -> int:
    """Bytes of the packed weight copies ``optimize_cpu_layout`` added (0 if none): their
    logical size; oneDNN's blocked layout may pad a little more."""
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            total += packed.numel() * packed.element_size()
    return total
