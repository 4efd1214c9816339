"""Triton FP8 block-scaled GEMM and activation quantization vs torch references.

Tolerances (relative error ||out - ref|| / ||ref||):
- GEMM vs the float32 product of the *same* quantized activation and the dequantized weight:
  1e-5 for float32 outputs (only the summation order differs, split-K included), 1e-2 for bf16
  outputs (the output's bf16 rounding, 2^-8).
- the whole FP8 linear vs the unquantized-activation product: 6e-2 (e4m3 keeps 3 mantissa bits:
  each activation moves by <= 2^-4 relative, ~3% RMS).
- activation quantization on CUDA: codes equal torch's round-to-nearest cast of x / scale, exactly.
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (small shapes; the interpreter's float8 cast
may round differently, so the quantization check is CUDA only).
"""

import pytest
import torch

from deepinfer.kernels.fp8 import (dequantize_block_fp8, fp8_block_linear, quantize_activation_fp8,
                                   quantize_block_fp8)
from deepinfer.kernels.settings import KernelConfig
from gpu_common import DEVICE, relative_error, requires_triton

pytestmark = [pytest.mark.gpu, requires_triton]

SHAPES = [(1, 200, 300), (20, 128, 256), (40, 64, 1024)]   # (M, N, K): partial tiles, split-K
if DEVICE == "cuda":   # DeepSeek-V2-Lite's linears at decode and prefill sizes
    SHAPES += [(64, 576, 2048), (300, 21888, 2048), (7, 2048, 10944)]


def _quantized_product(x, weight, scale_inv):
    """float32 product of the kernel's own activation codes and the dequantized weight."""
    from deepinfer.kernels.fp8_gemm_triton import quantize_activation

    codes, scales = quantize_activation(x)
    k = x.shape[1]
    x_deq = codes.float() * scales.repeat_interleave(128, dim=1)[:, :k]
    return x_deq @ dequantize_block_fp8(weight, scale_inv, (128, 128), torch.float32).T


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_gemm_matches_dequantized_product(shape):
    from deepinfer.kernels.fp8_gemm_triton import fp8_block_linear as triton_linear

    rows, n, k = shape
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    weight, scale_inv = (t.to(DEVICE) for t in quantize_block_fp8(w, (128, 128)))
    bias = torch.randn(n, generator=gen).to(DEVICE)
    expected = _quantized_product(x, weight, scale_inv) + bias
    out = triton_linear(x, weight, scale_inv, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert relative_error(out, expected) < 1e-5
    if DEVICE == "cuda":
        out_bf16 = triton_linear(x.bfloat16(), weight, scale_inv, bias.bfloat16())
        assert out_bf16.dtype == torch.bfloat16
        expected_bf16 = _quantized_product(x.bfloat16(), weight, scale_inv) + bias
        assert relative_error(out_bf16, expected_bf16) < 1e-2
        full = x @ dequantize_block_fp8(weight, scale_inv, (128, 128), torch.float32).T + bias
        assert relative_error(out_bf16, full) < 6e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="float8 rounding of the interpreter differs")
def test_activation_quantization_rounds_like_torch():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 700, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    codes, scales = quantize_activation_fp8(x)
    padded = torch.zeros(33, 768, device=DEVICE)
    padded[:, :700] = x.float()
    groups = padded.view(33, 6, 128)
    expected_scales = groups.abs().amax(-1).clamp(min=1e-10) / 448.0
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    expected = (groups / expected_scales[..., None]).view(33, 768)[:, :700].to(
        torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_block_linear_fallback_when_disabled():
    """`KernelConfig(fp8_block_gemm=False)` (and CPU) dequantizes the weight and runs F.linear."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=gen).to(DEVICE)
    weight, scale_inv = (t.to(DEVICE) for t in
                         quantize_block_fp8(torch.randn(64, 256, generator=gen) * 0.1, (128, 128)))
    out = fp8_block_linear(x, weight, scale_inv, block_size=(128, 128),
                           settings=KernelConfig(fp8_block_gemm=False))
    dense = dequantize_block_fp8(weight, scale_inv, (128, 128), torch.float32)
    torch.testing.assert_close(out, x @ dense.T, atol=1e-5, rtol=1e-5)
