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
3. `launch_dependents`, right after the wait or after the main loop (`TRIGGER_AFTER_LOOP`), so
   at most two kernels overlap: the running one and the next one's pre-wait prologue.

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
# True: signal dependents after the main loop (they overlap the epilogue and the drain only);
# False: right after the wait (the next kernel's programs may start as soon as they fit)
TRIGGER_AFTER_LOOP = True
# bytes of its weight rows each GEMM program prefetches into L2 before the wait (0: none)
PREFETCH_BYTES_PER_ROW = 0


def supported(device: torch.device) -> bool:
    """PDL is on for `device`: ENABLED, a CUDA device of compute capability 9.0 or newer, and
    Triton compiling for it (not the interpreter)."""
    return ENABLED and device.type == "cuda" and _hopper_or_newer(device.index)


@functools.cache
def _hopper_or_newer(index: int | None) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


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
