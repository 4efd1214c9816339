"""Gated MLP (SwiGLU): `down(silu(gate(x)) * up(x))` with gate and up fused in one linear."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.models.layers.linear import Linear
from deepinfer.kernels.activation import silu_and_mul
from deepinfer.kernels.fused_linear import AddedRows


class GatedMLP(nn.Module):
    """gate_up_proj.weight is [2 * intermediate_size, hidden_size]: rows [0, I) are the gate
    projection, rows [I, 2I) the up projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden_size] -> [num_tokens, hidden_size], same dtype."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        return self.down_proj(silu_and_mul(gate_up))  # Triton on CUDA, torch ops elsewhere

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor | AddedRows | None, torch.Tensor]:
        """x, residual: [num_tokens, hidden_size] -> (pending, residual): down_proj's
        `Linear.forward_add`, the residual add in its epilogue where that runs fused."""
        return self.down_proj.forward_add(silu_and_mul(self.gate_up_proj(x)), residual)
