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
DeepSeek (engine/models/deepseek.py) uses the same two at its input norm (the merged q + kv_a
GEMM) and at o_proj and the MLPs' down projections; its post-attention norm feeds the router.

The residual stream travels as (pending, residual): the hidden state is residual + pending, and
pending is None once an epilogue has added it, or `AddedRows` when that epilogue also wrote the
new stream rows' sums of squares (one partial per output tile): the next fused RMSNorm + linear
then sums those partials instead of computing them from the stream (a pre-pass over x before
its K loop at up to 16 rows, one more x x^T tensor-core dot per K step from 32 rows). Where the
fused kernel is not used (its sweep found it slower for that shape, CPU, more rows than a
decode bucket, other dtypes), the same functions run the unfused ops: the add fused into the
RMSNorm kernel, `kernels.linear.linear`, `silu_and_mul`; the norm weight is then the all-ones
weight left by the fold, so both paths compute the same function.

Which shapes run fused: `benchmarks/fused_linear_sweep.py --write-configs` times, per row bucket
and per layer boundary (o -> gate_up, down -> qkv), the fused kernels against the unfused chain
in CUDA graphs and writes `kernels/configs/fused_linear_<device name>.json`; `fused_config`
returns the kernel config where that file marks the boundary fused (unless its unfused chain
was at least 1% faster), else None. On the H200 (benchmarks/RESULTS.md run 16) both boundaries
run fused at 1-16 and at 64 rows; in one process decode ran 10% faster fused than unfused at
batch 1, and 0.4% faster at 64 with the 64-row o -> gate_up boundary fused than unfused.

Numerics against the unfused ops: the fused norm scales the float32 product by 1 / rms instead
of rounding x / rms to the dtype before the GEMM; the folded weight W * g is rounded once at load.
Both are bf16 rounding: on a 3-layer random bf16 Llama the decode logits of the two paths differ
by 0.018 relative, and each differs from HF bf16 by ~0.03 (tests/engine/test_fused_llama_gpu.py,
H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.activation import silu_and_mul
from deepinfer.kernels.backends import triton_available, tuned_table
from deepinfer.kernels.linear import linear
from deepinfer.kernels.rms_norm import rms_norm
from deepinfer.kernels.settings import DEFAULT, KernelConfig

CONFIG_KIND = "fused_linear"   # kernels/configs/fused_linear_<device name>.json


def fold_norm_weight(norm_weight: torch.Tensor, weight: torch.Tensor) -> None:
    """Fold an RMSNorm weight into the linear that reads the norm's output, in place.

    Afterwards `linear(norm(x) * 1, weight)` equals the original `linear(norm(x) * g, weight)`
    up to rounding: weight[n, k] becomes weight[n, k] * g[k] (float32 product, rounded once)
    and norm_weight becomes all ones.

    Args:
        norm_weight: [in_features] g, the RMSNorm weight; set to ones.
        weight: [out_features, in_features], the linear's weight (bf16 / fp16 / float32);
            scaled column-wise.
    Raises:
        ValueError: an FP8 weight. Its value is codes x a scale per 128 x 128 block, so W * g
            is not its codes times g: it would need new codes and scales (a re-quantization,
            whose rounding the checkpoint did not choose). FP8 linears keep their norm.
    """
    if weight.dtype.itemsize == 1:
        raise ValueError(f"fold_norm_weight got a {weight.dtype} weight: a block-scaled FP8 "
                         "weight cannot absorb a column scale; keep the RMSNorm unfolded.")
    weight.copy_((weight.float() * norm_weight.float()[None, :]).to(weight.dtype))
    norm_weight.fill_(1.0)


def fused_table(entries) -> dict[tuple[str, int, int, int], dict]:
    """{(fusion, block_m, out_features, in_features): launch config} of the config-file entries
    whose sweep found the fused kernels faster than the unfused ops."""
    return {(e["fusion"], e["block_m"], e["out_features"], e["in_features"]): e["config"]
            for e in entries if e["fused_faster"]}




@dataclass(frozen=True)
class AddedRows:
    """`pending` after a fused residual GEMM that added its output into the stream and wrote
    the new stream rows' sums of squares: partials [tiles, T] float32 (row t: output tile t's
    columns; `linear_triton.linear`'s sum_squares_out)."""

    partials: torch.Tensor


def fused_config(fusion: str, x: torch.Tensor, weight: torch.Tensor,
                 settings: KernelConfig = DEFAULT) -> dict | None:
    """The fused kernel's launch config for x [M, in_features] times weight, or None (run the
    unfused ops): `settings.fused_linears`, CUDA bf16/fp16 2-D x of at most
    `settings.skinny_max_rows` rows with unit stride on the last dim, a contiguous weight of
    x's dtype, and a (fusion, row bucket, shape) that the device's sweep found faster fused (a
    shape without an entry runs unfused); never in the batch-invariant mode (its configs are
    chosen by row bucket). `fusion`: "norm", "norm_gated" or "residual"."""
    if not (settings.fused_linears and not settings.batch_invariant and x.is_cuda
            and x.dim() == 2
            and 0 < x.shape[0] <= settings.skinny_max_rows
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.is_contiguous() and triton_available()):
        return None
    from deepinfer.kernels.linear_triton import block_m

    table = tuned_table(CONFIG_KIND, weight.device, fused_table)
    return table.get((fusion, block_m(x.shape[0]), *weight.shape))


def add_norm_linear(pending: torch.Tensor | AddedRows | None, residual: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, *, gated: bool = False,
                    settings: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear(rms_norm(residual + pending))`, SiLU-gated if asked, with g folded into weight.

    Args:
        pending: [T, H] a sub-layer output not yet added to the stream (overwritten by the sum:
            the `rms_norm` residual contract), None (already added) or `AddedRows` (added, with
            the rows' sums of squares).
        residual: [T, H] the residual stream.
        norm_weight: [H] the RMSNorm weight after `fold_norm_weight` (all ones).
        eps: the RMSNorm epsilon.
        weight: [N, H] the folded linear weight ([2 I, H], gate rows then up rows, if gated).
        bias: [N] or None.
        gated: return silu(gate) * up ([T, I]) instead of the linear's output.
        settings: the kernel choices (`KernelConfig`).
    Returns:
        (output [T, N] or [T, I], the residual stream [T, H] after the add).
    """
    added = pending if isinstance(pending, AddedRows) else None
    if added is not None:
        pending = None
    fusion = "norm_gated" if gated else "norm"
    config = fused_config(fusion, residual, weight, settings) if pending is None else None
    if config is not None and not (gated and bias is not None):
        return fused_norm_linear(added, residual, eps, weight, bias, config, gated=gated,
                                 settings=settings), residual
    if pending is None:
        normed = rms_norm(residual, norm_weight, eps, settings=settings)
    else:
        normed, residual = rms_norm(pending, norm_weight, eps, residual, settings=settings)
    out = linear(normed, weight, bias, settings=settings)
    return (silu_and_mul(out) if gated else out), residual


def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor, *, settings: KernelConfig = DEFAULT
               ) -> tuple[torch.Tensor | AddedRows | None, torch.Tensor]:
    """`residual + linear(x)`, the add done in the GEMM's epilogue where the fused kernel runs.

    Args:
        x: [T, K]; weight: [H, K]; bias: [H] or None.
        residual: [T, H] the residual stream; overwritten by the sum when fused.
        settings: the kernel choices (`KernelConfig`).
    Returns:
        (pending, residual): (AddedRows, residual + x @ weight.T) when fused (None for the
        AddedRows with `settings.sum_squares_handoff` off), else (x @ weight.T, residual) for
        the next `add_norm_linear` (or RMSNorm) to add.
    """
    config = fused_config("residual", x, weight, settings)
    if config is None:
        return linear(x, weight, bias, settings=settings), residual
    return fused_linear_add(x, weight, bias, residual, config, settings=settings)


def fused_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor, config: dict, *,
                     settings: KernelConfig = DEFAULT) -> tuple[AddedRows | None, torch.Tensor]:
    """`linear_add`'s fused kernel with launch `config`: (AddedRows, or None with
    `settings.sum_squares_handoff` off; the residual stream, added in place)."""
    from deepinfer.kernels import linear_triton

    partials = None
    if settings.sum_squares_handoff:
        partials = torch.empty((linear_triton.num_partials(weight.shape[0], config), x.shape[0]),
                               dtype=torch.float32, device=x.device)
    residual = linear_triton.linear(x, weight, bias, config=config, residual=residual,
                                    sum_squares_out=partials, settings=settings)
    return (None if partials is None else AddedRows(partials)), residual


def fused_norm_linear(added: AddedRows | None, residual: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, config: dict, *,
                      gated: bool = False, settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`add_norm_linear`'s fused kernel with launch `config` on a stream with nothing pending:
    the norm's sums of squares from `added` where given, else from the stream's rows."""
    from deepinfer.kernels import linear_triton

    return linear_triton.linear(residual, weight, bias, config=config, norm_eps=eps,
                                gated=gated, settings=settings,
                                sum_squares=None if added is None else added.partials)
