"""The L2 prefetch kernel of `kernels/l2_prefetch.py` (Triton, sm_90).

Each thread (one warp per program) owns one chunk of CHUNK_BYTES and issues one
`cp.async.bulk.prefetch.L2.global [address], size` for it (PTX ISA 8.0; address 16-byte
aligned, size a multiple of 16): the bulk copy engine fetches the bytes into L2 and the thread
does not wait, so a program lasts a few hundred cycles whatever the size. The last chunk is cut
to the byte count; threads past it issue nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK_BYTES = 16384   # bytes per bulk prefetch
LANES = 32            # chunks per program: one per thread of its single warp


@triton.jit
def _l2_prefetch_kernel(base_address, num_bytes, CHUNK_BYTES: tl.constexpr,
                        LANES: tl.constexpr):
    chunk = tl.program_id(0) * LANES + tl.arange(0, LANES)
    offset = chunk.to(tl.int64) * CHUNK_BYTES
    size = tl.minimum(num_bytes - offset, CHUNK_BYTES).to(tl.int32)   # <= 0: nothing to fetch
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [base_address + offset, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(address: int, num_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Queue on the current stream a kernel that prefetches `num_bytes` (a multiple of 16)
    starting at device `address` (16-byte aligned) into L2. chunk_bytes: a multiple of 16."""
    chunks = triton.cdiv(num_bytes, chunk_bytes)
    _l2_prefetch_kernel[(triton.cdiv(chunks, LANES),)](
        address, num_bytes, CHUNK_BYTES=chunk_bytes, LANES=LANES, num_warps=1, num_stages=1)
