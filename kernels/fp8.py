"""Block-scaled FP8 (DeepSeek-V3 checkpoints): dequantization, activation quantization, and the
block-scaled linear.

DeepSeek-V3 (arXiv 2412.19437 §3.3.2) stores linear weights as float8_e4m3fn with one float32
scale per `[block_n, block_k]` tile (128 x 128); the checkpoint names the tensor
`weight_scale_inv`, and `weight = fp8_weight * weight_scale_inv` tile by tile. Edge tiles may be
partial (out/in features not multiples of the block).

Public ops (CUDA runs Triton, `kernels/fp8_gemm_triton.py`; other devices torch):
- `quantize_activation_fp8`: per token, per 128-channel group scales (DeepGEMM's activation
  recipe), for the linears and the MoE experts' FP8 GEMMs.
- `fp8_block_linear`: `x @ (W * scales).T + bias` from FP8 codes, float32 accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.backends import triton_available
from deepinfer.kernels.settings import DEFAULT, KernelConfig

FP8_MAX = 448.0   # float8_e4m3fn's largest finite value


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


def fp8_supported(device: torch.device) -> bool:
    """True where the Triton FP8 GEMM runs: a CUDA device of compute capability >= 8.9 (Ada,
    Hopper) with Triton installed."""
    return (device.type == "cuda" and triton_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_activation_fp8(x: torch.Tensor, group_size: int = 128
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-`group_size`-channel FP8 quantization (DeepSeek-V3 §3.3.2, DeepGEMM).

    Args:
        x: [M, K] float (bf16 / fp16 / fp32).
        group_size: channels per scale (128 to match 128 x 128 weight tiles).
    Returns:
        (codes [M, K] float8_e4m3fn, scales [M, ceil(K / group_size)] float32), with
        x ~= codes * scale of its group and scale = max(amax, 1e-10) / 448. Triton on CUDA
        (one kernel), torch elsewhere; both round the same way (x / scale, round to nearest).
    """
    if x.is_cuda and triton_available():
        from deepinfer.kernels.fp8_gemm_triton import quantize_activation

        return quantize_activation(x, group_size)
    rows, k = x.shape
    groups = -(-k // group_size)
    padded = x.new_zeros(rows, groups * group_size, dtype=torch.float32)
    padded[:, :k] = x.float()
    tiles = padded.view(rows, groups, group_size)
    scales = tiles.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX               # [M, G]
    codes = (tiles / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows, -1)[:, :k].contiguous(), scales


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, *, block_size: tuple[int, int],
                     settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`x @ W.T + bias` for a block-scaled FP8 weight W = weight * weight_scale_inv (per tile).

    Args:
        x: [..., K] bf16 / fp16 / fp32.
        weight: [N, K] float8_e4m3fn; weight_scale_inv: [ceil(N/bn), ceil(K/bk)] float32.
        bias: [N] or None.
        block_size: (bn, bk), the checkpoint's weight_block_size.
        settings: `fp8_block_gemm` False (or a CPU tensor) runs the torch fallback: dequantize
            the weight to x's dtype, then `F.linear` (the reference the GEMM is tested against).
    Returns:
        [..., N], x's dtype. The Triton GEMM quantizes x per token and 128 channels and
        accumulates in float32 (relative error vs the fallback ~1e-2: x's FP8 rounding).
    """
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x.is_cuda and settings.fp8_block_gemm and tuple(block_size) == (128, 128) and \
            fp8_supported(x.device):
        from deepinfer.kernels.fp8_gemm_triton import fp8_block_linear as triton_linear

        out = triton_linear(x2d, weight, weight_scale_inv, bias, block_size=block_size,
                            settings=settings)
    else:
        dense = dequantize_block_fp8(weight, weight_scale_inv, block_size, x.dtype)
        out = F.linear(x2d, dense, bias)
    return out.reshape(*lead, weight.shape[0])
