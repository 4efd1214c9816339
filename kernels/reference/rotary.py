"""Reference rotary embedding (Llama / GPT-NeoX halves) in torch ops. The test oracle."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of `x`: x * cos + rotate_half(x) * sin (Su et al. 2021, RoFormer).

    Args:
        x: [num_tokens, num_heads, head_dim] (a strided view of a fused projection is fine).
        cos, signed_sin: [num_tokens, 1, head_dim]; signed_sin = (-sin, sin) over the halves.
    Returns:
        [num_tokens, num_heads, head_dim], a new contiguous tensor of x's dtype.
    """
    num_tokens, num_heads, head_dim = x.shape
    # (x1, x2) -> (x2, x1); signed_sin turns it into rotate_half(x) * sin = (-x2 sin, x1 sin)
    swapped = x.view(num_tokens, num_heads, 2, head_dim // 2).flip(2).view(x.shape)
    return torch.addcmul(x * cos, swapped, signed_sin)
