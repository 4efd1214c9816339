"""Decode linears with their neighbouring elementwise ops folded in: fewer kernels per step.

A Llama layer at decode is, per token, RMSNorm -> qkv -> rotary -> attention -> o -> add ->
RMSNorm -> gate_up -> SiLU-mul -> down -> add. At a few rows each RMSNorm, SiLU-mul and add is a
kernel of a few microseconds whose cost is the launch and the gap it leaves, not its bytes
(~2 us each in a decode graph on an H200: 64 RMSNorms took 0.13 ms per step, benchmarks/
RESULTS.md run 10). Here they ride on the GEMMs (`kernels/linear_triton.py`):
- `add_norm_linear`: RMSNorm then a linear. The norm's weight g is folded into the linear's
  weight once at load (`fold_norm_weight`: W' = W * g, so norm(x) * g @ W.T = norm(x) @ W'.T);
  the GEMM takes the rows' sums of squares (a pre-pass over x, or x x^T in its K loop from 32
  rows per program) and scales its accumulator by the inverse RMS. With `gated`, SiLU(gate) *
  up is applied in the same epilogue.
- `linear_add`: a linear whose epilogue adds the residual stream in place.

The residual stream travels as (pending, residual): the hidden state is residual + pending, and
pending is None once an epilogue has added it. Where the fused kernel is not used (its sweep
found it slower for that shape, CPU, more rows than a decode bucket, other dtypes), the same
functions run the unfused ops: the add fused into the RMSNorm kernel, `kernels.linear.linear`,
`silu_and_mul`; the norm weight is then the all-ones weight left by the fold, so both paths
compute the same function.

Which shapes run fused: `benchmarks/fused_linear_sweep.py --write-configs` times, per row bucket
and per layer boundary (o -> gate_up, down -> qkv), the fused kernels against the unfused chain
in CUDA graphs and writes `kernels/configs/fused_linear_<device name>.json`; `fused_config`
returns the kernel config where that file says the fused boundary was faster, else None. On
the H200 (benchmarks/RESULTS.md run 13) both boundaries run fused up to 16 rows (SWAP_AB
tiles) and o -> gate_up at 64 rows; decode at batch 1 ran 5% faster fused than unfused in one
process. At 64 rows either choice is within the sweep's run-to-run noise (~1-3%).

Numerics against the unfused ops: the fused norm scales the float32 product by 1 / rms instead
of rounding x / rms to the dtype before the GEMM; the folded weight W * g is rounded once at load.
Both are bf16 rounding: on a 3-layer random bf16 Llama the decode logits of the two paths differ
by 0.018 relative, and each differs from HF bf16 by ~0.03 (tests/engine/test_fused_llama_gpu.py,
H200).
"""

from __future__ import annotations

import functools

import torch

from kernels.activation import silu_and_mul
from kernels.backends import device_config_entries, triton_available
from kernels.linear import SKINNY_MAX_ROWS, linear
from kernels.rms_norm import rms_norm

CONFIG_KIND = "fused_linear"   # kernels/configs/fused_linear_<device name>.json


def fold_norm_weight(norm_weight: torch.Tensor, weight: torch.Tensor) -> None:
    """Fold an RMSNorm weight into the linear that reads the norm's output, in place.

    Afterwards `linear(norm(x) * 1, weight)` equals the original `linear(norm(x) * g, weight)`
    up to rounding: weight[n, k] becomes weight[n, k] * g[k] (float32 product, rounded once)
    and norm_weight becomes all ones.

    Args:
        norm_weight: [in_features] g, the RMSNorm weight; set to ones.
        weight: [out_features, in_features], the linear's weight; scaled column-wise.
    """
    weight.copy_((weight.float() * norm_weight.float()[None, :]).to(weight.dtype))
    norm_weight.fill_(1.0)


@functools.cache
def _fused_table(device: torch.device) -> dict[tuple[str, int, int, int], dict]:
    """{(fusion, block_m, out_features, in_features): launch config} where the device's sweep
    found the fused kernels faster than the unfused ops; {} without a config file."""
    return {(e["fusion"], e["block_m"], e["out_features"], e["in_features"]): e["config"]
            for e in device_config_entries(CONFIG_KIND, device) if e["fused_faster"]}


# False: every call takes the unfused ops (benchmarks compare the two in one process)
ENABLED = True


def fused_config(fusion: str, x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The fused kernel's launch config for x [M, in_features] times weight, or None (run the
    unfused ops): CUDA bf16/fp16 2-D x of at most SKINNY_MAX_ROWS rows with unit stride on
    the last dim, a contiguous weight of x's dtype, and a (fusion, row bucket, shape) that the
    device's sweep found faster fused. `fusion`: "norm", "norm_gated" or "residual"."""
    if not (ENABLED and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.is_contiguous() and triton_available()):
        return None
    from kernels.linear_triton import block_m

    table = _fused_table(weight.device)
    return table.get((fusion, block_m(x.shape[0]), *weight.shape)) if table else None


def add_norm_linear(pending: torch.Tensor | None, residual: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, *, gated: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear(rms_norm(residual + pending))`, SiLU-gated if asked, with g folded into weight.

    Args:
        pending: [T, H] a sub-layer output not yet added to the stream, or None. When given it
            is overwritten by the sum (the `rms_norm` residual contract).
        residual: [T, H] the residual stream.
        norm_weight: [H] the RMSNorm weight after `fold_norm_weight` (all ones).
        eps: the RMSNorm epsilon.
        weight: [N, H] the folded linear weight ([2 I, H], gate rows then up rows, if gated).
        bias: [N] or None.
        gated: return silu(gate) * up ([T, I]) instead of the linear's output.
    Returns:
        (output [T, N] or [T, I], the residual stream [T, H] after the add).
    """
    fusion = "norm_gated" if gated else "norm"
    config = fused_config(fusion, residual, weight) if pending is None else None
    if config is not None and not (gated and bias is not None):
        from kernels import linear_triton

        out = linear_triton.linear(residual, weight, bias, config=config, norm_eps=eps,
                                   gated=gated)
        return out, residual
    if pending is None:
        normed = rms_norm(residual, norm_weight, eps)
    else:
        normed, residual = rms_norm(pending, norm_weight, eps, residual)
    out = linear(normed, weight, bias)
    return (silu_and_mul(out) if gated else out), residual


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`residual + linear(x)`, the add done in the GEMM's epilogue where the fused kernel runs.

    Args:
        x: [T, K]; weight: [H, K]; bias: [H] or None.
        residual: [T, H] the residual stream; overwritten by the sum when fused.
    Returns:
        (pending, residual): (None, residual + x @ weight.T) when fused, else
        (x @ weight.T, residual) for the next `add_norm_linear` (or RMSNorm) to add.
    """
    config = fused_config("residual", x, weight)
    if config is not None:
        from kernels import linear_triton

        return None, linear_triton.linear(x, weight, bias, config=config, residual=residual)
    return linear(x, weight, bias), residual
