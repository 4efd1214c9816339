"""Reference RMSNorm with the optional fused residual add, in torch ops. The test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`s / sqrt(mean(s^2) + eps) * weight` over the last dim, s = x (+ residual).

    Args:
        x: [num_tokens, hidden_size]. With a residual, x is overwritten in place by x + residual.
        weight: [hidden_size], x's dtype.
        eps: added to the mean square.
        residual: [num_tokens, hidden_size] or None.
    Returns:
        normed [num_tokens, hidden_size] without a residual; otherwise (normed, x) with x now
        holding x + residual.
    """
    if residual is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    x = x.add_(residual)
    return F.rms_norm(x, weight.shape, weight, eps), x
