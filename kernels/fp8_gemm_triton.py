"""FP8 block-scaled GEMM in Triton (DeepGEMM's recipe, DeepSeek-V3 arXiv 2412.19437 §3.3.2).

- Activations: `quantize_activation` scales each token's each 128-channel group by its own
  float32 factor (amax / 448, e4m3's largest value) and rounds to float8_e4m3fn.
- Weights: float8_e4m3fn [N, K] with one float32 `weight_scale_inv` per 128 x 128 tile, as the
  checkpoint stores them (never re-quantized here).
- `_fp8_gemm_kernel`: program (row tile, column tile [, K split]); per 128-wide K step it runs
  one FP8 tensor-core dot of the raw codes into a fresh float32 tile and adds it to the float32
  accumulator times (activation scale per row) x (weight scale of the tile) - the "promotion to
  CUDA cores" that the V3 report prescribes, at every K block (DeepGEMM does the same). BLOCK_N
  divides 128, so one weight scale covers a whole program's columns per K step.
- Split-K for skinny (decode) GEMMs: when the row x column tiles alone would leave SMs idle,
  K is cut into SPLIT_K slices that atomically add float32 partials; the result is cast after.

Departures from DeepGEMM: no TMA / warp specialisation / persistent scheduler (Triton picks the
pipelining), no JIT per shape beyond Triton's own; scales are read as [N/128, K/128] row-major
(DeepGEMM wants TMA-aligned column-major activation scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import backends
from deepinfer.kernels.settings import DEFAULT, KernelConfig

FP8_MAX = 448.0
GROUP = 128   # activation scale group and weight scale tile edge (K); weight tile edge (N)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, x_stride, K, NUM_GROUPS,
                     GROUP_SIZE: tl.constexpr, FP8_MAX_VALUE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    mask = cols < K
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / FP8_MAX_VALUE
    q = tl.clamp(x / scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * NUM_GROUPS + group, scale)


def quantize_activation(x: torch.Tensor, group_size: int = GROUP
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-`group_size`-channel FP8 quantization (CUDA).

    Args:
        x: [M, K] bf16 / fp16 / fp32, unit last stride.
    Returns:
        (codes [M, K] float8_e4m3fn, scales [M, ceil(K / group_size)] float32) with
        x ~= codes * scale of its group; scale = max(amax, 1e-10) / 448.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    groups = triton.cdiv(k, group_size)
    codes = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(rows, groups)](x, codes, scales, x.stride(0), k, groups,
                                         GROUP_SIZE=group_size, FP8_MAX_VALUE=FP8_MAX,
                                         num_warps=1)
    return codes, scales


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, bias_ptr, M, N, K,
                     a_stride, w_stride, out_stride, k_groups, w_scale_stride,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_SCALE_N: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(k_groups, SPLIT_K)
    first = split * steps
    last = tl.minimum(first + steps, k_groups)
    w_scale_row = w_scale_ptr + (pid_n * BLOCK_N // BLOCK_SCALE_N) * w_scale_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(first, last):
        k = step * BLOCK_K + kk
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * a_stride + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)        # [M, K] fp8
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * w_stride + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)        # [N, K] fp8
        a_scale = tl.load(a_scale_ptr + rows * k_groups + step, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_row + step)
        partial = tl.dot(a, tl.trans(w))                                    # [M, N] fp32
        acc += partial * (a_scale[:, None] * w_scale)
    if HAS_BIAS:
        if split == 0:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    offsets = rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + offsets, acc, mask=mask, sem="relaxed")


def _tiles(rows: int, out_features: int, in_features: int, num_sms: int,
           settings: KernelConfig) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K): host ints only."""
    if rows > 256:
        block_m, block_n = 128, 128
    else:
        block_m = max(16, min(triton.next_power_of_2(rows), settings.fp8_gemm_block_m))
        block_n = 64
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(out_features, block_n)
    k_steps = triton.cdiv(in_features, GROUP)
    split_k = 1
    while tiles * split_k * 2 <= num_sms and split_k * 2 <= k_steps // 2:
        split_k *= 2
    return block_m, block_n, split_k


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, *, block_size: tuple[int, int] = (128, 128),
                     settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`x @ W.T + bias` with W = weight * weight_scale_inv per 128 x 128 tile, on CUDA.

    Args:
        x: [M, K] bf16 / fp16 (quantized here per token and 128 channels).
        weight: [N, K] float8_e4m3fn; weight_scale_inv: [ceil(N/128), ceil(K/128)] float32.
        bias: [N] or None.
        block_size: the checkpoint's weight_block_size; (128, 128) is what the kernel supports.
    Returns:
        [M, N], x's dtype; fp32 accumulation. Tolerance vs the dequantized float32 product:
        the activation's FP8 rounding, ~2e-2 relative.
    Raises:
        ValueError: a block size other than (128, 128).
    """
    if tuple(block_size) != (GROUP, GROUP):
        raise ValueError(f"the FP8 GEMM supports weight_block_size [128, 128]; got "
                         f"{list(block_size)}.")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    codes, scales = quantize_activation(x)
    num_sms = backends.num_sms(x.device.index or 0) if x.is_cuda else 8
    block_m, block_n, split_k = _tiles(rows, out_features, in_features, num_sms, settings)
    if split_k > 1:
        out = torch.zeros(rows, out_features, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), split_k)
    _fp8_gemm_kernel[grid](
        codes, scales, weight, weight_scale_inv, out, bias if bias is not None else out,
        rows, out_features, in_features, codes.stride(0), weight.stride(0), out.stride(0),
        scales.shape[1], weight_scale_inv.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, BLOCK_SCALE_N=GROUP, SPLIT_K=split_k,
        num_warps=8 if block_m >= 128 else 4, num_stages=3)
    return out.to(x.dtype) if split_k > 1 else out
