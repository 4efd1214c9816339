"""Requesting the next kernel's weight into L2 from a kernel that leaves DRAM bandwidth unused.

A decode step's attention reads its KV cache at ~0.7 of the copy bandwidth (a chain of dependent
loads per program; benchmarks/RESULTS.md run 19), and the o GEMM after it starts reading its
weight only once the attention's programs have left the SMs. The attention's programs can
instead request a slice of that weight into L2 as they start (PTX ISA
`cp.async.bulk.prefetch.L2.global`, sm_90: a bulk copy into L2 that nothing waits on), so DRAM
streams the weight while the attention's chains run and the GEMM reads it from L2.

Weights are written by no kernel, so the request may precede `griddepcontrol.wait`
(`kernels/pdl.py`). The request changes no value, only where bytes come from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def prefetch_rows(base_ptr, rows, row_stride, row_bytes, program, programs,
                  EVICT_LAST: tl.constexpr):
    """Request into L2 the first row_bytes bytes (a multiple of 16) of each of this program's
    rows of a row-major matrix at base_ptr (rows rows, row_stride elements apart; rows are
    dealt out in contiguous runs of cdiv(rows, programs), 128 at a time: one per thread of a
    4-warp program). EVICT_LAST: with the evict-last L2 policy (`createpolicy`), so that a
    stream of normal loads does not evict the lines first. Returns at once: nothing waits on
    the copies."""
    per = tl.cdiv(rows, programs)
    lane = tl.arange(0, 128)
    for start in range(0, per, 128):
        row = program * per + start + lane
        ok = ((start + lane) < per) & (row < rows)
        ptrs = base_ptr + row.to(tl.int64) * row_stride
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 policy; setp.ne.b32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, policy; "
                "mov.u32 $0, 0; }",
                "=r,l,r,r", [ptrs, ok.to(tl.int32), row_bytes + 0 * lane], dtype=tl.int32,
                is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
                "=r,l,r,r", [ptrs, ok.to(tl.int32), row_bytes + 0 * lane], dtype=tl.int32,
                is_pure=False, pack=1)


def row_prefix(weight: torch.Tensor | None, fraction: float) -> tuple[int, int] | None:
    """(rows, bytes of each row's prefix) for `prefetch_rows` over `fraction` of each row of
    a 2-D weight ([rows, K], unit stride on K, 16-byte aligned rows), or None where there is
    nothing to request (no weight, fraction 0, a layout the bulk copy cannot take)."""
    if (not isinstance(weight, torch.Tensor) or fraction <= 0 or weight.dim() != 2
            or weight.stride(1) != 1):
        return None
    size = weight.element_size()
    if weight.data_ptr() % 16 or (weight.stride(0) * size) % 16:
        return None
    prefix = int(weight.shape[1] * size * min(fraction, 1.0)) // 16 * 16
    return (weight.shape[0], prefix) if prefix else None
