"""Programmatic dependent launch (PDL) for the decode kernels on Hopper, and L2 weight prefetch.

In a decode graph each kernel waits for the whole previous kernel: its launch, its programs'
prologues and the first loads of its weights (a few microseconds of HBM latency) sit in the
gap, while the previous kernel's last programs leave SMs idle as they drain. At batch 1 a
Llama-3-8B step is ~170 such kernels (benchmarks/RESULTS.md run 13: kernel sum 4.14 ms for
3.55 ms of bytes at the copy bandwidth).

PDL (CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA
`griddepcontrol`) lets the next kernel start before this one ends. A kernel launched with
`launch_pdl=True` may begin once every program of the previous kernel has executed
`griddepcontrol.launch_dependents` (or exited); its `griddepcontrol.wait` then blocks until the
previous kernel has completed and its memory is visible. The pattern in our kernels:

1. prefetch what does not depend on the previous kernel: the program's first weight bytes,
   into L2 (`prefetch_l2`, the bulk `cp.async.bulk.prefetch.L2` of sm_90); nothing is
   written and nothing another kernel writes is read before the wait;
2. `wait`: from here on the program may read the previous kernel's output and write anything;
3. `launch_dependents`, right after the wait (`RELEASE_EARLY`) or after the main loop, so at
   most two kernels overlap: the running one and the next one's pre-wait prologue.

The wait is transitive (a kernel completes only after its own wait returned), so every kernel
sees all earlier kernels' writes, as without PDL. Kernels launched without the attribute
(torch, cuBLAS) serialise as usual. CUDA graph capture keeps the launch attribute as a
programmatic dependency edge. Off the GPU (the interpreter, CPU) the constexpr PDL flag is
False and the kernels compile without the instructions.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# False: launch every kernel without PDL (benchmarks compare the two in one process)
ENABLED = True
# the kernel families launched with PDL when ENABLED: "linear" (the skinny GEMM), "attention"
# (the one-kernel rotary decode attention), "rms_norm"
FAMILIES = frozenset({"linear", "attention", "rms_norm"})
# families that release the next kernel right after their wait; the others release it after
# their main loop. A GEMM released early by a GEMM lands on the SMs that happen to be free and
# doubles up there (H200, Llama-3-8B batch 1: 204.9 tok/s against 241.3 released after the loop,
# 237.5 without PDL; benchmarks/RESULTS.md run 14); the decode attention is latency-bound, and
# releasing the o GEMM at its start lets o prefetch its weight meanwhile (`linear_triton.linear
# (prefetch_weight=True)`)
RELEASE_EARLY = frozenset({"attention", "rms_norm"})
# False: no GEMM prefetches its weight before its wait, whatever its caller asks
WEIGHT_PREFETCH = True


def supported(device: torch.device) -> bool:
    """PDL is on for `device`: ENABLED, a CUDA device of compute capability 9.0 or newer, and
    Triton compiling for it (not the interpreter)."""
    return ENABLED and device.type == "cuda" and _hopper_or_newer(device.index)


@functools.cache
def _hopper_or_newer(index: int | None) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def release_after_loop(family: str) -> bool:
    """The TRIGGER_AFTER_LOOP constexpr of a kernel of `family`."""
    return family not in RELEASE_EARLY


def launch_options(device: torch.device, family: str) -> dict:
    """Extra launch kwargs for a kernel of `family` (one of FAMILIES' names) on `device`: {}
    where PDL is off for it; `kernel[grid](..., PDL=bool(options), **options)`."""
    return {"launch_pdl": True} if family in FAMILIES and supported(device) else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel completed and its writes are visible (no-op if not PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Allow the next kernel to launch once all programs got here (no-op if not PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(addresses, num_bytes):
    """Prefetch `num_bytes` (a multiple of 16) from each 16-byte aligned address into L2.

    Args:
        addresses: int64 tensor of global addresses (one bulk prefetch each; replicated
            elements prefetch twice, which costs an instruction, not bytes).
        num_bytes: int32 tensor of addresses' shape, the bytes from each.
    """
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [addresses, num_bytes], dtype=tl.int32, is_pure=False,
                              pack=1)
