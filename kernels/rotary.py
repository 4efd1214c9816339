"""Rotary position embedding applied to a varlen batch of heads: `apply_rotary`.

Backends: "reference" (`kernels/reference/rotary.py`, torch ops, any device) and "triton"
(`kernels/elementwise_triton.py`, one kernel on CUDA). `backend="auto"` takes "triton" for CUDA
tensors where Triton is installed, else "reference". Triton vs reference: bf16 within one ulp
(same rounding steps), float32 ~1e-6.
"""

from __future__ import annotations

import torch

from kernels.backends import triton_available

BACKENDS = ("reference", "triton")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 backend: str = "auto") -> torch.Tensor:
    """Rotate each head of `x`: x * cos + rotate_half(x) * sin.

    Args:
        x: [num_tokens, num_heads, head_dim] (strided views ok; unit stride on head_dim).
        cos, signed_sin: [num_tokens, 1, head_dim] in x's dtype; signed_sin = (-sin, sin).
        backend: "auto", "reference" or "triton".
    Returns:
        [num_tokens, num_heads, head_dim], a new contiguous tensor of x's dtype.
    """
    if backend == "auto":
        use_triton = x.is_cuda and x.stride(-1) == 1 and triton_available()
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        from kernels import elementwise_triton

        return elementwise_triton.apply_rotary(x, cos, signed_sin)
    if backend != "reference":
        raise ValueError(f"rotary backend={backend!r} is unknown; use 'auto' or one of "
                         f"{BACKENDS}.")
    from kernels.reference.rotary import apply_rotary as reference

    return reference(x, cos, signed_sin)
