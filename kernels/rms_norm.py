"""RMSNorm with the optional fused residual add: `rms_norm`, dispatched to a backend.

Backends, imported lazily on first use:
- "reference": `kernels/reference/rms_norm.py`, `x.add_(residual)` + `F.rms_norm` (the oracle).
- "cpu": `kernels/csrc/rms_norm_avx2.cpp` in the one CPU extension (kernels/cpu_extension.py):
  the add, the fp32 sum of squares and the scaled output in one C++ call per step, instead of
  torch's per-op overhead (~54 us per call at decode on a small CPU). CPU float32 only.
- "triton": `kernels/elementwise_triton.py`, add + norm in one CUDA kernel (bf16/fp16/fp32).
`backend="auto"` picks "cpu" for CPU float32 inputs where the extension is available, "triton"
for CUDA inputs where Triton is installed, else "reference".

Numerics: fp32 accumulation (8-lane partial sums), within 1e-6 relative of torch.rms_norm.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.backends import triton_available
from deepinfer.kernels.settings import DEFAULT, KernelConfig

BACKENDS = ("reference", "cpu", "triton")


def _cpu_ok(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """True if the "cpu" backend handles these inputs: CPU float32 [T, H] with unit stride along
    H, a contiguous weight, a residual of x's shape. (Kept to cheap attribute reads: at decode
    this check runs ~60 times per step.)"""
    f32 = torch.float32
    return (x.is_cpu and x.dtype is f32 and x.dim() == 2 and x.stride(1) == 1
            and weight.dtype is f32 and weight.is_contiguous()
            and (residual is None or (residual.dtype is f32 and residual.stride(-1) == 1
                                      and residual.shape == x.shape)))


_loaded = []  # [module or None] once the extension was asked for


def _extension():
    if not _loaded:
        from deepinfer.kernels.cpu_extension import cpu_extension

        _loaded.append(cpu_extension())
    return _loaded[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, backend: str = "auto", *,
             settings: KernelConfig = DEFAULT) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise `x`, or `x + residual` when a residual is given.

    Args:
        x: [num_tokens, hidden_size]. With a residual, x is overwritten in place by x + residual
            (it must be a fresh sub-layer output that nothing else reads).
        weight: [hidden_size], x's dtype.
        eps: added to the mean square.
        residual: [num_tokens, hidden_size] or None.
        backend: "auto", "reference", "cpu" (CPU float32 2-D only) or "triton" (CUDA).
        settings: the kernel choices (`KernelConfig`: the Triton kernel's PDL launch).
    Returns:
        normed [num_tokens, hidden_size] (a new tensor) without a residual; otherwise
        (normed, x), x holding x + residual: the next layer's residual.
    """
    if backend == "auto":
        ext = _extension() if _cpu_ok(x, weight, residual) else None
        if ext is not None:  # the hot path: one C++ call
            normed = ext.rms_norm(x, weight, eps, residual)
            return normed if residual is None else (normed, x)
        use_triton = x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and triton_available()
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        from deepinfer.kernels import elementwise_triton

        return elementwise_triton.rms_norm(x, weight, eps, residual, settings=settings)
    if backend not in BACKENDS:
        raise ValueError(f"rms_norm backend={backend!r} is unknown; use 'auto' or one of "
                         f"{BACKENDS}.")
    if backend == "reference":
        from deepinfer.kernels.reference.rms_norm import rms_norm as reference

        return reference(x, weight, eps, residual)
    ext = _extension()
    if ext is None:
        raise RuntimeError("rms_norm backend 'cpu' is unavailable here (see the logged warning); "
                           "use backend='reference' or 'auto'.")
    if not _cpu_ok(x, weight, residual):
        raise ValueError(f"rms_norm backend 'cpu' needs CPU float32 [T, H] inputs with unit "
                         f"stride along H; got {x.dtype} {tuple(x.shape)} on {x.device}.")
    normed = ext.rms_norm(x, weight, eps, residual)
    return normed if residual is None else (normed, x)
