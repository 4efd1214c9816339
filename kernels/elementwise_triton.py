"""Triton kernels for the small per-token ops of a decoder layer (the "triton" backends of
`kernels/rms_norm.py`, `kernels/rotary.py` and `kernels/activation.py`), and rotary fused with
the KV-cache write (`apply_rotary_write_kv`: one kernel per layer instead of two).

At decode each op moves a few kilobytes per token, so its cost is the launch, not the bytes: one
fused kernel replaces the 2-4 torch ops of the reference (add + norm; mul + flip + addcmul; silu +
mul). Rounding follows the torch references step by step (e.g. the residual sum is rounded to the
activation dtype before it is normalised, as `x.add_(residual)` does), so bf16 results match them
to within one bf16 ulp in most elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.settings import DEFAULT, KernelConfig


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride,
                     out_stride, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pdl.wait_and_release(PDL, True)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * x_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, normed * weight, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, settings: KernelConfig = DEFAULT
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`kernels.rms_norm.rms_norm`'s contract: x [T, H] (unit stride on H; overwritten by
    x + residual when a residual is given), weight [H]; returns normed or (normed, x).
    `settings.pdl`: launched with PDL on Hopper."""
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x
        pdl_options = pdl.launch_options(x.device, settings)
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=bool(pdl_options),
            num_warps=min(16, max(1, block // 256)), **pdl_options)
    return out if residual is None else (out, x)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_stride_t, x_stride_h, cos_stride_t,
                   sin_stride_t, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    src = x_ptr + token * x_stride_t + heads * x_stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    d_ok = dims < HALF
    cos1 = tl.load(cos_ptr + token * cos_stride_t + dims, mask=d_ok, other=0.0)
    cos2 = tl.load(cos_ptr + token * cos_stride_t + HALF + dims, mask=d_ok, other=0.0)
    sin1 = tl.load(sin_ptr + token * sin_stride_t + dims, mask=d_ok, other=0.0)   # -sin
    sin2 = tl.load(sin_ptr + token * sin_stride_t + HALF + dims, mask=d_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # as the reference: addcmul(x * cos (rounded), swapped, signed_sin) in float32, rounded once
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + x2.to(tl.float32) * sin1.to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + x1.to(tl.float32) * sin2.to(tl.float32)
    dst = out_ptr + token * num_heads * (2 * HALF) + heads * (2 * HALF) + dims
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`kernels.rotary.apply_rotary`'s contract: x [T, H, D] (unit stride on D), cos and
    signed_sin [T, 1, D] (unit stride on D); returns a new contiguous [T, H, D]."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, cos, signed_sin, out, x.stride(0), x.stride(1), cos.stride(0),
            signed_sin.stride(0), num_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4)
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, out_stride, intermediate,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * gate_up_stride + intermediate + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(dtype)   # F.silu rounds to the dtype
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`kernels.activation.silu_and_mul`'s contract: gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    num_tokens, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), intermediate, BLOCK=block,
            num_warps=4)
    return out


@triton.jit
def _rotary_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, cache_ptr, slot_ptr,
                            qkv_stride_t, cos_stride_t, sin_stride_t, v_offset,
                            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                            BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    head_dim = 2 * HALF
    heads = tl.arange(0, BLOCK_H)[:, None]                    # q heads, then k heads
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = dims < HALF
    mask = (heads < NUM_Q_HEADS + NUM_KV_HEADS) & d_ok
    src = qkv_ptr + token * qkv_stride_t + heads * head_dim + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    cos1 = tl.load(cos_ptr + token * cos_stride_t + dims, mask=d_ok, other=0.0)
    cos2 = tl.load(cos_ptr + token * cos_stride_t + HALF + dims, mask=d_ok, other=0.0)
    sin1 = tl.load(sin_ptr + token * sin_stride_t + dims, mask=d_ok, other=0.0)   # -sin
    sin2 = tl.load(sin_ptr + token * sin_stride_t + HALF + dims, mask=d_ok, other=0.0)
    dtype = q_out_ptr.dtype.element_ty
    # the rounding steps of _rotary_kernel (and of the torch reference)
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + x2.to(tl.float32) * sin1.to(tl.float32)
            ).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + x1.to(tl.float32) * sin2.to(tl.float32)
            ).to(dtype)
    q_dst = q_out_ptr + token * (NUM_Q_HEADS * head_dim) + heads * head_dim + dims
    is_q = mask & (heads < NUM_Q_HEADS)
    tl.store(q_dst, out1, mask=is_q)
    tl.store(q_dst + HALF, out2, mask=is_q)
    k_dst = cache_ptr + slot * (NUM_KV_HEADS * head_dim) + (heads - NUM_Q_HEADS) * head_dim + dims
    is_k = mask & (heads >= NUM_Q_HEADS) & ((slot + 0 * heads) >= 0)   # [H, 1]: slot -1 skips
    tl.store(k_dst, out1, mask=is_k)
    tl.store(k_dst + HALF, out2, mask=is_k)
    kv_heads = tl.arange(0, BLOCK_KV)[:, None]
    full_dims = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    v_mask = (kv_heads < NUM_KV_HEADS) & (full_dims < head_dim) & ((slot + 0 * kv_heads) >= 0)
    value = tl.load(qkv_ptr + token * qkv_stride_t + (NUM_Q_HEADS + NUM_KV_HEADS) * head_dim
                    + kv_heads * head_dim + full_dims, mask=v_mask)
    tl.store(cache_ptr + v_offset + slot * (NUM_KV_HEADS * head_dim) + kv_heads * head_dim
             + full_dims, value, mask=v_mask)


def apply_rotary_write_kv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                          cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """`kernels.rotary.apply_rotary_write_kv`'s contract: qkv [T, (Hq + 2 Hkv) * D] (unit
    stride on the last dim), cos / signed_sin [T, 1, D], kv_cache [2, N, B, Hkv, D] contiguous,
    slot_mapping [T] int64 (-1: no write); returns the rotated query [T, Hq, D], contiguous."""
    num_tokens = qkv.shape[0]
    head_dim = kv_cache.shape[-1]
    query = torch.empty((num_tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_write_kv_kernel[(num_tokens,)](
            qkv, cos, signed_sin, query, kv_cache, slot_mapping, qkv.stride(0), cos.stride(0),
            signed_sin.stride(0), kv_cache[0].numel(), NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_q_heads + num_kv_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return query
