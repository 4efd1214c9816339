"""RMSNorm, with the residual add of the previous sub-layer fused in."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.rms_norm import rms_norm
from deepinfer.kernels.settings import DEFAULT, KernelConfig


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension (weight [hidden_size]).
    `kernel_config`: the GPU kernel choices (`layers.set_kernel_config` sets the engine's)."""

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`, or `x + residual` when a residual is given.

        `kernels.rms_norm` with backend "auto": CPU float32 inputs run the fused C++ op, other
        devices and dtypes the torch reference (`x.add_(residual)` + `F.rms_norm`).

        Args:
            x: [num_tokens, hidden_size]. With a residual, x is overwritten by x + residual
                (it must be a fresh sub-layer output that nothing else reads).
            residual: [num_tokens, hidden_size] or None.
        Returns:
            normed [num_tokens, hidden_size] without a residual; otherwise
            (normed, x + residual), the sum being the next layer's residual.
        """
        return rms_norm(x, self.weight, self.eps, residual, settings=self.kernel_config)
