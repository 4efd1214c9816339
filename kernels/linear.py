"""Dense linear `y = x @ weight.T + bias`, optionally through a weight pre-packed for CPU GEMM.

On CPU, float32 `F.linear` goes to MKL sgemm on the row-major weight; for the small-M shapes of
decode (M = number of sequences) oneDNN on a weight reordered once into its blocked layout is
~1.5-3x faster (the vocab projection at M=16: ~3x). `pack_linear_weight` makes that copy at load
time; `linear` uses it when given. The reference is plain `F.linear` (the packed path is tested
against it). Packing returns None where it does not apply (other devices, other dtypes, torch
built without oneDNN), and `linear` then falls back to `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of `weight` for fast CPU GEMM, or None where packing does not apply.

    Args:
        weight: [out_features, in_features] float32 on CPU (anything else returns None).
    Returns:
        An opaque mkldnn tensor, only for `linear(..., packed=...)`; the caller keeps `weight`.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not _onednn_packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`.

    Args:
        x: [..., in_features], weight's dtype.
        weight: [out_features, in_features].
        bias: [out_features] or None.
        packed: `pack_linear_weight(weight)` or None; used instead of `weight` when given.
    Returns:
        [..., out_features], x's dtype.
    """
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
