"""Programmatic Dependent Launch (PDL) for the Triton kernels of a decode step: `use_pdl`.

A decode step at small batch is a chain of short kernels (RMSNorm, GEMM, rotary + KV write,
attention, ...) replayed from a CUDA graph; each kernel normally starts only once the previous
one has finished and drained, so every boundary costs the next kernel's launch and prologue.
With PDL (compute capability >= 9.0; CUDA C++ Programming Guide, "Programmatic Dependent Launch
and Synchronization"; PTX ISA `griddepcontrol`) a kernel launched with the programmatic
stream-serialization attribute (Triton: `kernel[grid](..., launch_pdl=True)`) may be scheduled
as soon as every program of the previous kernel has executed `griddepcontrol.launch_dependents`
(`tl.extra.cuda.gdc_launch_dependents()`), and its programs then block in `griddepcontrol.wait`
(`tl.extra.cuda.gdc_wait()`) until the previous kernel has completed and its memory writes are
visible. The kernels here call both first thing, so a kernel's launch overlaps its predecessor's
tail. The rule that keeps this correct: before its `gdc_wait` a kernel reads nothing another
kernel writes and writes nothing (reading immutable weights is fine: the skinny GEMM prefetches
its first weight tiles into L2 there).

Each kernel takes a `USE_PDL: tl.constexpr` and its launcher passes `USE_PDL=pdl,
launch_pdl=pdl` with `pdl = use_pdl(device)`; with USE_PDL False none of it is compiled in.

Wide kernels (`wide=True`: the skinny GEMM and the paged-attention kernels, grids of about one
program per SM or more, each program streaming its share of the bytes) are left out unless
PDL_WIDE_KERNELS is set: launched early, beside the previous kernel's programs, they ran slower
(probably placed unevenly over the SMs). H200, torch 2.11, Triton 3.6, bf16, CUDA graphs of 8
Llama-3-8B decode layers (context 1000; cuBLAS qkv / gate_up, Triton o / down GEMMs), us per
replay at 1 / 16 / 64 rows: PDL off 1025-1054 / 1203 / 1616; small kernels only (RMSNorm,
SiLU-mul, rotary + KV write) 1030 / 1182 / 1601; wide kernels too 1134 / 1315 / 1603. 8
back-to-back down-projection GEMMs at 1 row: 252 us, 320 with PDL (dropping the L2 prefetch or
moving every trigger after the wait left most of the loss in a layer chain). 200 chained
RMSNorms: 334 -> 244 us with PDL.

This module imports no Triton (CPU installs have none).
"""

from __future__ import annotations

import functools
import os

import torch

# False turns PDL off everywhere (benchmarks compare); read at every launch, so set it before
# capturing CUDA graphs.
PDL_ENABLED = True

# True also launches the wide kernels (skinny GEMM, paged attention) with PDL: measured slower
# (module docstring), kept for experiments.
PDL_WIDE_KERNELS = False


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def use_pdl(device: torch.device, *, wide: bool = False) -> bool:
    """True where a Triton kernel on `device` is launched with PDL: PDL_ENABLED (and, for a
    `wide` kernel, PDL_WIDE_KERNELS), a CUDA device of compute capability >= 9.0, and not
    Triton's CPU interpreter (TRITON_INTERPRET=1, which has no `griddepcontrol`)."""
    if not PDL_ENABLED or (wide and not PDL_WIDE_KERNELS) or device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0)
