"""Weights prefetched into the GPU's L2 on a side stream while decode's small kernels run.

A Llama decode layer at small batch is a chain: RMSNorm, the qkv GEMM, rotary + KV write,
attention (+ split reduce), the o GEMM, RMSNorm, the gate_up GEMM, SiLU-mul, the down GEMM. The
GEMMs stream their weights from DRAM; the kernels between them read almost nothing (Llama-3-8B
shapes at batch 1 on an H200: ~14 us of them per layer, `benchmarks/RESULTS.md` run 10) and each
GEMM starts with an empty pipeline, so DRAM idles between the GEMMs.

Inside a `weight_prefetch(device)` region (the CUDA graph runner opens one around each decode
graph it captures), `prefetch_weight(w)` forks a side stream at the main stream's current point
and launches `kernels/l2_prefetch_triton.py` there: each of its threads asks the L2 for one chunk
of w's first bytes with `cp.async.bulk.prefetch.L2.global` (PTX ISA 8.0, sm_90), which the bulk
copy engine carries out while the thread moves on, so the kernel ends at once and the fetch runs
beside the main stream's next kernels. The GEMM that reads w later finds those bytes in L2.
Leaving the region joins the side stream into the main one (a graph capture needs every fork
joined before it ends).

A prefetch is a hint: it changes no value (the GPU tests compare steps with and without it bit
for bit). It costs L2 room, so at most `MAX_BYTES` of one weight are asked for. Outside a region,
off CUDA, before sm_90 or without Triton, `prefetch_weight` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from kernels.backends import triton_available

# The CUDA graph runner prefetches in decode graphs of at most this many rows (0: never). Past
# ~256 rows a decode step's GEMMs are bound by the matmul rate, not by reading the weights.
PREFETCH_MAX_ROWS = 256

# At most this many bytes of one weight per prefetch (the H200's L2 is 60 MB; this is the whole
# Llama-3-8B o_proj, and about 14 us of copy bandwidth).
MAX_BYTES = 32 << 20


class _Region:
    """One open `weight_prefetch` region: the stream it was opened on and the side stream."""

    def __init__(self, main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
        self.main, self.side = main, side
        self.forked = False


_region: contextvars.ContextVar[_Region | None] = contextvars.ContextVar("l2_prefetch_region",
                                                                         default=None)
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def supported(device: torch.device) -> bool:
    """True where prefetches are issued: a CUDA device of compute capability >= 9.0 (the bulk
    prefetch instruction) with Triton installed."""
    return (device.type == "cuda" and triton_available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


@contextlib.contextmanager
def weight_prefetch(device: torch.device, *, enabled: bool = True) -> Iterator[None]:
    """A region in which `prefetch_weight` prefetches on `device` (a no-op region where
    `enabled` is False or the device is not `supported`). On exit the current stream waits for
    the side stream's prefetch kernels (not for the fetches, which nothing waits for).

    Open it outside a graph capture once first: the side stream is made on the first entry.
    """
    device = torch.device(device)
    if not (enabled and supported(device)):
        yield
        return
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    region = _Region(torch.cuda.current_stream(device), _side_streams[device])
    token = _region.set(region)
    try:
        yield
    finally:
        _region.reset(token)
        if region.forked:
            region.main.wait_stream(region.side)


def prefetch_weight(weight: torch.Tensor, max_bytes: int = MAX_BYTES) -> None:
    """Inside a region: start fetching the first min(max_bytes, weight's bytes) of `weight`
    into L2, behind the work queued so far on the region's stream. Elsewhere: nothing.

    Args:
        weight: a contiguous CUDA tensor, 16-byte aligned (any other is left alone).
        max_bytes: the most bytes to ask for; rounded down to a multiple of 16.
    """
    region = _region.get()
    if region is None or not weight.is_cuda or not weight.is_contiguous():
        return
    num_bytes = min(weight.numel() * weight.element_size(), max_bytes) // 16 * 16
    if num_bytes <= 0 or weight.data_ptr() % 16:
        return
    from kernels import l2_prefetch_triton

    region.side.wait_stream(region.main)
    with torch.cuda.stream(region.side):
        l2_prefetch_triton.prefetch(weight.data_ptr(), num_bytes)
    region.forked = True
