"""Prefetch a weight into the GPU's L2 cache while latency-bound kernels leave DRAM idle.

At DeepSeek-V2-Lite decode of one token the attention half of a MoE layer is a chain of small
dependent kernels (~30 us for ~28 MB of weights, ~6.5 us at copy bandwidth), and the MoE half
right after it streams ~138 MB (routed experts and the shared experts beside them on a second
stream). `prefetch_l2` launches, on the shared experts' stream while the attention chain runs,
one small kernel whose threads issue Hopper bulk L2 prefetches (PTX ISA 8.0
`cp.async.bulk.prefetch.L2.global`, sm_90), 16 KiB each, over a weight's bytes, so that the
shared experts' GEMMs later read them from L2 instead of competing with the routed experts for
DRAM. A prefetch is a hint: it moves no data a kernel depends on, needs no synchronisation,
and a line evicted before use is simply read again from DRAM.

With `evict_last` the lines carry the L2 evict-last policy (`createpolicy.fractional`), so the
attention weights streaming past them are evicted first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 16384   # bytes per bulk prefetch instruction
BLOCK = 128           # prefetch instructions per program

_ASM_NORMAL = ("cp.async.bulk.prefetch.L2.global [$1], 16384;\n"
               "mov.u32 $0, 0;")
_ASM_EVICT_LAST = ("{\n.reg .b64 policy;\n"
                   "createpolicy.fractional.L2::evict_last.b64 policy, 1.0;\n"
                   "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], 16384, policy;\n"
                   "mov.u32 $0, 0;\n}")


@triton.jit
def _l2_prefetch_kernel(base_ptr, sink_ptr, num_bytes, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, ASM: tl.constexpr):
    """Program p prefetches chunks [p * BLOCK, (p + 1) * BLOCK) of CHUNK bytes from base_ptr
    (uint8); the last chunk is moved back to end at num_bytes (overlap is harmless). The
    asm's result is always 0: the masked store never writes and only keeps the instruction."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = tl.minimum(idx.to(tl.int64) * CHUNK, num_bytes - CHUNK)
    done = tl.inline_asm_elementwise(ASM, "=r,l", [base_ptr + start], dtype=tl.int32,
                                     is_pure=False, pack=1)
    tl.store(sink_ptr + idx, done, mask=done != 0)


@functools.cache
def _sink(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def supported(weight: torch.Tensor) -> bool:
    """Whether `prefetch_l2` prefetches `weight`: a contiguous CUDA tensor of at least
    CHUNK_BYTES bytes, a multiple of 16, on a device of compute capability >= 9.0."""
    return (weight.is_cuda and weight.is_contiguous()
            and torch.cuda.get_device_capability(weight.device) >= (9, 0)
            and weight.numel() * weight.element_size() >= CHUNK_BYTES
            and (weight.numel() * weight.element_size()) % 16 == 0
            and weight.data_ptr() % 16 == 0)


def prefetch_l2(weight: torch.Tensor, *, evict_last: bool = False) -> None:
    """Issue L2 prefetches over all of `weight`'s bytes on the current stream (one launch,
    ceil(bytes / (CHUNK_BYTES * BLOCK)) programs). Does nothing where not `supported`.

    Args:
        weight: any contiguous CUDA tensor (read only by the hardware's prefetch).
        evict_last: mark the prefetched lines evict-last in L2.
    """
    if not supported(weight):
        return
    num_bytes = weight.numel() * weight.element_size()
    chunks = triton.cdiv(num_bytes, CHUNK_BYTES)
    sink = _sink(weight.device)
    _l2_prefetch_kernel[(triton.cdiv(chunks, BLOCK),)](
        weight.view(-1).view(torch.uint8), sink, num_bytes, CHUNK=CHUNK_BYTES, BLOCK=BLOCK,
        ASM=_ASM_EVICT_LAST if evict_last else _ASM_NORMAL, num_warps=4)
