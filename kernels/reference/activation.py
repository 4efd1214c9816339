"""Reference SwiGLU activation in torch ops. The test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer").

    Args:
        gate_up: [num_tokens, 2 * intermediate]; columns [0, I) gate, [I, 2I) up.
    Returns:
        [num_tokens, intermediate], gate_up's dtype (a new tensor).
    """
    intermediate = gate_up.shape[-1] // 2
    hidden = F.silu(gate_up[:, :intermediate])  # [T, I], contiguous
    return hidden.mul_(gate_up[:, intermediate:])
