"""Reference block-quantized linear: dequantize in torch, then `F.linear`. The test oracle.

Formats (ggml's, 32 weights per block along in_features; see `kernels/quantized_linear.py`):
- Q4_1: w = d * q + m, q in 0..15 (4 bits), d and m fp16 per block (evaluated in float32).
- Q8_0: w = d * q, q in -127..127 (int8), d fp16 per block.

Nibble layout of Q4_1 (ggml's): byte j of a block holds element j in its low nibble and element
j + 16 in its high nibble.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32


def unpack_q4_1_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed: [N, K/2] uint8 (ggml nibble order) -> codes [N, K] uint8 in 0..15."""
    num_rows = packed.shape[0]
    blocks = packed.reshape(num_rows, -1, BLOCK_SIZE // 2)           # [N, K/32, 16]
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)          # [N, K/32, 32]
    return codes.reshape(num_rows, -1)


def dequantize(qweight) -> torch.Tensor:
    """The float32 weight a `QuantizedWeight` stands for, exactly as ggml dequantizes it.

    Args:
        qweight: `kernels.quantized_linear.QuantizedWeight` of shape [N, K].
    Returns:
        [N, K] float32.
    """
    num_rows, num_cols = qweight.shape
    scales = qweight.scales.float().unsqueeze(-1)                    # [N, K/32, 1]
    if qweight.format == "q4_1":
        codes = unpack_q4_1_codes(qweight.codes).float().reshape(num_rows, -1, BLOCK_SIZE)
        # d * q is exact in float32 (11-bit d times 4-bit q): one rounding, in the + m.
        weight = scales * codes + qweight.mins.float().unsqueeze(-1)
    elif qweight.format == "q8_0":
        codes = qweight.codes.float().reshape(num_rows, -1, BLOCK_SIZE)
        weight = scales * codes
    else:
        raise ValueError(f"quantized format {qweight.format!r} is unknown; use 'q4_1' or 'q8_0'.")
    return weight.reshape(num_rows, num_cols)


def quantized_linear(x: torch.Tensor, qweight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ dequantize(qweight).T + bias`.

    Args:
        x: [M, K] float32.
        qweight: `QuantizedWeight` [N, K].
        bias: [N] float32 or None.
    Returns:
        [M, N] float32.
    """
    return F.linear(x, dequantize(qweight), bias)
