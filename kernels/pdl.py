"""Programmatic dependent launch (PDL) for the decode kernels on Hopper.

In a decode graph each kernel starts only when the previous one has ended: its launch and its
programs' prologues sit in the gap between the two. At batch 1 a Llama-3-8B step is ~170
kernels (benchmarks/RESULTS.md run 13: graph replay 4.28 ms for a kernel sum of 4.14 ms).

PDL (CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA
`griddepcontrol`) lets the next kernel start before this one ends. A kernel launched with
`launch_pdl=True` may begin once every program of the previous kernel has executed
`griddepcontrol.launch_dependents` (or exited); its `griddepcontrol.wait` then blocks until the
previous kernel has completed and its memory is visible. In our kernels:

1. `wait` comes before anything that reads another kernel's output or writes memory (only
   program ids, arguments and, in the Gluon GEMM, the weights before it);
2. `launch_dependents` comes right after the wait for the kernels in
   `KernelConfig.pdl_release_early`, else
   after the kernel's main loop (a GEMM's K loop), so at most two kernels overlap: the running
   one and the next one's launch.

The wait is transitive (a kernel completes only after its own wait returned), so every kernel
sees all earlier kernels' writes, as without PDL. Kernels launched without the attribute
(torch, cuBLAS) serialise as usual. CUDA graph capture keeps the launch attribute as a
programmatic dependency edge. Off the GPU (the interpreter, CPU) the constexpr PDL flag is
False and the kernels compile without the instructions.

Measured (H200, Llama-3-8B decode, one process; benchmarks/RESULTS.md run 14): 240.6 / 1836.3
/ 12262.8 tok/s at batch 1 / 8 / 64 against 237.3 / 1822.7 / 12096.7 without PDL. GEMMs
releasing the next kernel right after their wait were slower at batch 1 (219.3; every kernel
so: 204.9): the next GEMM's programs start on whichever SMs are free while the current GEMM
runs and double up there. Prefetching the o GEMM's weight into L2 before its wait, while the
latency-bound attention ran, was slower too (237.3), and was removed. So were loads into
registers before the wait (benchmarks/RESULTS.md run 15): each GEMM's first weight tile (b=1
227.9 against 243.3 without) and the decode attention's metadata and first K / V tile (241.9
against 243.3; 5.1 against 7.0 us per layer in a chain of attention kernels alone). What
did pay is the Gluon GEMM (`kernels/linear_gluon.py`, 64 rows): TMA copies of its first weight
tiles into its shared-memory stages before the wait, x's after: +2.4-2.9% at batch 64 against
the same kernel requesting both after the wait (run 18).

Weights are the one input that may be read before the wait: no kernel writes them. Rule 1
above holds for everything else.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer.kernels.settings import DEFAULT, KernelConfig

# Which kernels release early (`KernelConfig.pdl_release_early`, default
# `settings.PDL_RELEASE_EARLY`): "linear" (the Triton skinny GEMM), "linear_gluon", "attention"
# (the one-kernel rotary decode attention; either way: 240.6 / 240.5 tok/s at batch 1), or
# "linear_gluon ROLE" for the Gluon GEMMs of one epilogue role (`linear_gluon.epilogue_role`).
# The RMSNorm kernel has no loop and releases right after its wait. The Gluon GEMMs whose next
# kernel is a GEMM (gate_up -> down, o / down -> the next norm GEMM) release early: its programs
# take the SMs this GEMM leaves idle (o's 64 programs, gate_up's second wave of 92) and stream
# their first weight stages there while this one runs; benchmarks/RESULTS.md run 23: +0.9-1.5%
# at batch 64. qkv (next: the attention, whose early programs can only wait) releasing early
# lost 1.7-2.2%.


def supported(device: torch.device, settings: KernelConfig = DEFAULT) -> bool:
    """PDL is on for `device`: `settings.pdl`, a CUDA device of compute capability 9.0 or
    newer, and a Triton that has it (`tl.extra.cuda.gdc_wait`; 3.6 on the device) compiling for
    it (not the interpreter)."""
    return settings.pdl and device.type == "cuda" and _hopper_or_newer(device.index)


def _interpreting() -> bool:
    """Triton runs kernels in its interpreter (its own TRITON_INTERPRET knob, read by Triton)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


@functools.cache
def _hopper_or_newer(index: int | None) -> bool:
    if _interpreting() or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def release_after_loop(kernel: str, role: str | None = None,
                       settings: KernelConfig = DEFAULT) -> bool:
    """The TRIGGER_AFTER_LOOP constexpr of `kernel` ("linear", "linear_gluon", "attention" or
    "mla_reduce", MLA's split reduce with W_UV); a GEMM whose epilogue has `role` ("gated",
    "residual", "norm", "plain") also releases early where `settings.pdl_release_early` names
    "kernel role"."""
    early = settings.pdl_release_early
    return kernel not in early and f"{kernel} {role}" not in early


def launch_options(device: torch.device, settings: KernelConfig = DEFAULT) -> dict:
    """Extra launch kwargs for a PDL kernel on `device` ({} where PDL is off):
    `kernel[grid](..., PDL=bool(options), **options)`."""
    return {"launch_pdl": True} if supported(device, settings) else {}


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
def wait_and_release(PDL: tl.constexpr, RELEASE: tl.constexpr):
    """`wait`, then `launch_dependents` if RELEASE (a kernel that releases right after its
    wait; the others release after their main loop)."""
    wait(PDL)
    if RELEASE:
        launch_dependents(PDL)
