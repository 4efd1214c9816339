"""Dense linear `y = x @ weight.T + bias`, optionally through a weight pre-packed for CPU GEMM.

On CPU, float32 `F.linear` goes to MKL sgemm on the row-major weight; for the small-M shapes of
decode (M = number of sequences) oneDNN on a weight reordered once into its blocked layout is
~1.5-3x faster (the vocab projection at M=16: ~3x). `pack_linear_weight` makes that copy at load
time; `linear` uses it when given. The reference is plain `F.linear` (the packed path is tested
against it). Packing returns None where it does not apply (other devices, other dtypes, torch
built without oneDNN), and `linear` then falls back to `F.linear`.

On CUDA, bf16 / fp16 inputs of at most `KernelConfig.skinny_max_rows` rows (decode batches) run the Triton
skinny GEMM (`kernels/linear_triton.py`) for the shapes where a sweep on that device measured it
faster than cuBLAS (its tuned-config file); every other CUDA call uses `F.linear`, through
cuBLASLt where `kernels/blas_choice.py`'s sweep file says it beat cuBLAS for that shape.
`linear_row_argmax` also returns each row's first maximal column where the skinny GEMM runs
(the argmax taken in its epilogue: a greedy LM head without a pass over the logits).

Weights that are exactly the dequantized values of ggml Q4_1 / Q8_0 blocks (GGUF checkpoints)
also get a `QuantizedWeight` (`quantize_linear_weight`): up to `KernelConfig.quantized_max_rows`
input rows,
`linear` then runs the AVX2 block-quantized kernel (`kernels/quantized_linear.py`), which reads
4-6x fewer bytes per token and gives the same values up to float32 summation order. Larger
inputs (prefill chunks) are compute-bound and stay on the float32 GEMM.

Batch-invariant mode (`KernelConfig.batch_invariant`) on CPU: every row's bits must not depend
on the rows beside it or on their number, and MKL / oneDNN choose kernels and blockings by M.
A weight with a quantized form then always runs the quantized kernel with `row_invariant`
(whatever M, prefill included), any other float32 weight our own fixed-order float32 kernel
(`csrc/f32_linear_avx2.cpp`, no packed copy used); without the C++ extension, or for other
dtypes, each row is its own `F.linear` call (same shape every call: slow, invariant). On CUDA
every call runs the Triton GEMM at one config per weight shape (`linear_triton.
invariant_config`: 64-row tiles whatever M, one K split), never cuBLAS or the tuned skinny
configs, whose choices depend on M.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.backends import triton_available
from deepinfer.kernels.blas_choice import preferred_library, preferring
from deepinfer.kernels.quantized_linear import QuantizedWeight, cpu_kernel_available, quantized_linear
from deepinfer.kernels.quantized_linear import recover_quantized
from deepinfer.kernels.settings import DEFAULT, KernelConfig

# `KernelConfig.quantized_max_rows` (64): up to it the quantized kernel was measured faster than
# oneDNN's packed fp32 GEMM (2-core AVX2 machine, SmolLM2-135M shapes: 1.25x at 64 rows); larger
# inputs (prefill chunks) were not measured and stay on the float32 GEMM.


def _onednn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of `weight` for fast CPU GEMM, or None where packing does not apply.

    Args:
        weight: [out_features, in_features] float32 on CPU (anything else returns None).
    Returns:
        An opaque mkldnn tensor, only for `linear(..., packed=...)`; the caller keeps `weight`.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not _onednn_packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def quantize_linear_weight(weight: torch.Tensor) -> QuantizedWeight | None:
    """The exact Q4_1 / Q8_0 form of `weight`, or None where it has none or it would not be used.

    Args:
        weight: [out_features, in_features] float32 on CPU (anything else returns None).
    Returns:
        A QuantizedWeight for `linear(..., quantized=...)`; the caller keeps `weight`.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return recover_quantized(weight)


def skinny_config(x: torch.Tensor, weight: torch.Tensor,
                  settings: KernelConfig = DEFAULT) -> dict | None:
    """The Triton skinny GEMM's tuned config for this call, or None (use F.linear): CUDA
    bf16/fp16 2-D x of at most `settings.skinny_max_rows` rows with unit stride on the last
    dim, a contiguous weight of x's dtype, and a shape the device's sweep found faster than
    cuBLAS."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] <= settings.skinny_max_rows
            and not settings.batch_invariant
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(-1) == 1 and weight.is_contiguous() and triton_available()):
        return None
    from deepinfer.kernels import linear_triton

    return linear_triton.tuned_config(x.shape[0], weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None,
           quantized: QuantizedWeight | None = None, *,
           settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`x @ weight.T + bias`.

    Args:
        x: [..., in_features], weight's dtype.
        weight: [out_features, in_features].
        bias: [out_features] or None.
        packed: `pack_linear_weight(weight)` or None; used instead of `weight` when given.
        quantized: `quantize_linear_weight(weight)` or None; used for inputs of at most
            `settings.quantized_max_rows` rows where the AVX2 kernel is available.
        settings: the kernel choices (`KernelConfig`).
    Returns:
        [..., out_features], x's dtype.
    """
    if settings.batch_invariant:
        if x.is_cuda:
            return _row_invariant_cuda(x, weight, bias, settings)
        return _row_invariant_cpu(x, weight, bias, quantized)
    config = skinny_config(x, weight, settings)
    if config is not None:
        from deepinfer.kernels import linear_triton

        return linear_triton.linear(x, weight, bias, config=config, settings=settings)
    if (quantized is not None and x.numel() <= settings.quantized_max_rows * x.shape[-1]
            and cpu_kernel_available()):
        return quantized_linear(x, quantized, bias, backend="cpu_avx2")
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if x.is_cuda and x.dim() == 2 and (library := preferred_library(x.shape[0], weight,
                                                                    settings)):
        with preferring(library):
            return F.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _row_invariant_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        settings: KernelConfig) -> torch.Tensor:
    """`linear` on CUDA in batch-invariant mode: the Triton GEMM at a config fixed by the
    weight's shape (`linear_triton.invariant_config`; no Gluon, no split-K).

    Raises:
        ValueError: Triton is missing, or x / weight are not a CUDA float pair it takes.
    """
    if not (triton_available() and weight.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"batch-invariant linear on CUDA needs Triton and a bf16 / fp16 / "
                         f"float32 weight of x's dtype; got {weight.dtype} x {x.dtype}")
    from deepinfer.kernels import linear_triton

    x2d = x.reshape(-1, x.shape[-1])
    y = linear_triton.linear(x2d, weight, bias, config=linear_triton.invariant_config(weight),
                             settings=settings)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _row_invariant_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       quantized: QuantizedWeight | None) -> torch.Tensor:
    """`linear` on CPU in batch-invariant mode (module docstring)."""
    x2d = x.reshape(-1, x.shape[-1])
    if cpu_kernel_available() and x.dtype == torch.float32:
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        if quantized is not None:
            y = quantized_linear(x2d, quantized, backend="cpu_avx2", row_invariant=True)
        else:
            from deepinfer.kernels.cpu_extension import cpu_extension

            y = cpu_extension().f32_linear(x2d, weight.contiguous())
        if bias is not None:
            y.add_(bias)
    else:
        y = torch.cat([F.linear(row, weight, bias) for row in x2d.split(1)]) if len(x2d) else (
            F.linear(x2d, weight, bias))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_row_argmax(x: torch.Tensor, weight: torch.Tensor, *, settings: KernelConfig = DEFAULT
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear(x, weight)` and, where the Triton skinny GEMM runs it, each row's first maximal
    column taken in its epilogue (`linear_triton.linear_row_argmax`: a greedy LM head without
    an argmax pass over the logits).

    Args:
        x: [M, in_features]; weight: [out_features, in_features] (no bias).
    Returns:
        (out [M, out_features] in x's dtype, [M] int64 `out.argmax(dim=-1)` or None where the
        GEMM ran elsewhere: the caller takes the argmax).
    """
    config = skinny_config(x, weight, settings)
    if config is None or not settings.row_argmax_epilogue:
        return linear(x, weight, settings=settings), None
    from deepinfer.kernels import linear_triton

    return linear_triton.linear_row_argmax(x, weight, config=config, settings=settings)
