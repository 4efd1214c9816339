"""Block-scaled FP8 weights (DeepSeek-V3 checkpoints) dequantized to a compute dtype.

DeepSeek-V3 (arXiv 2412.19437 §3.3.2) stores linear weights as float8_e4m3fn with one float32
scale per `[block_n, block_k]` tile (128 x 128); the checkpoint names the tensor
`weight_scale_inv`, and `weight = fp8_weight * weight_scale_inv` tile by tile. Edge tiles may be
partial (out/in features not multiples of the block).
"""

from __future__ import annotations

import torch


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Dequantize one block-scaled FP8 weight.

    Args:
        weight: [out_features, in_features] float8_e4m3fn (or any float dtype).
        scale_inv: [ceil(out_features / block_n), ceil(in_features / block_k)] float32.
        block_size: (block_n, block_k), e.g. (128, 128).
        dtype: the result's dtype.
    Returns:
        [out_features, in_features] `dtype`: weight * scale of its tile, computed in float32.
    Raises:
        ValueError: the scale grid does not match the weight shape and block size.
    """
    out_features, in_features = weight.shape
    block_n, block_k = block_size
    grid = (-(-out_features // block_n), -(-in_features // block_k))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a weight of "
                         f"shape {(out_features, in_features)} with weight_block_size "
                         f"{list(block_size)} needs {grid}.")
    scale = (scale_inv.float().repeat_interleave(block_n, dim=0)[:out_features]
             .repeat_interleave(block_k, dim=1)[:, :in_features])
    return (weight.float() * scale).to(dtype)


def quantize_block_fp8(weight: torch.Tensor, block_size: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for building test checkpoints: per tile, scale = amax / 448 (e4m3's max).

    Args:
        weight: [out_features, in_features] float.
    Returns:
        (fp8 weight [out, in] float8_e4m3fn, scale_inv [ceil(out/bn), ceil(in/bk)] float32).
    """
    out_features, in_features = weight.shape
    block_n, block_k = block_size
    rows, cols = -(-out_features // block_n), -(-in_features // block_k)
    padded = weight.new_zeros(rows * block_n, cols * block_k, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    tiles = padded.view(rows, block_n, cols, block_k)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(
        torch.float8_e4m3fn).max  # [rows, cols]
    quantized = (tiles / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.view(padded.shape)[:out_features, :in_features].contiguous(), scale_inv
