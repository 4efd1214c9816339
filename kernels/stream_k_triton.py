"""Stream-K schedule for the skinny decode GEMM: every SM streams the same number of weight bytes.

Why: at decode a linear layer is a stream of its weight, and on an H200 one SM pulls only about
1/132 of the device bandwidth (~34 GB/s: the bytes it keeps in flight over the load latency).
With one program per output tile, the busiest SM sets the time: Llama-3-8B's qkv (6144 x 4096)
in 64-row tiles is 96 programs, so 36 SMs idle; gate_up's 224 gated tiles put two programs on
92 SMs and one on 40 (H200 at batch 1: 16.1 us against 11.4 us for the bytes at 4.4 TB/s, and
60 against 53; benchmarks/RESULTS.md run 13).

Schedule (Stream-K, Osama et al., PPoPP 2023, https://arxiv.org/abs/2301.03598): the work is
U = tiles x k_iters units (one [BLOCK_N, BLOCK_K] weight tile each, taken n-tile by n-tile, K
innermost); a grid of P persistent programs (P <= U, about a multiple of the SM count) gives
program p the units [p U / P, (p + 1) U / P) in one flat, software-pipelined loop, so the next
tile's loads are in flight while a tile finishes. A tile whose K range one program covers is
finished in that program (`linear_triton._epilogue`: norm scale, bias, SiLU-gate, residual).
A tile split between programs p_lo..p_hi: each stores its float32 partial ([BLOCK_M, BLOCK_N],
with the up half when gated) in its slot (slot 0: the first tile of its range, 1: the last),
then counts itself in on the tile's arrival counter (`kernels.backends.arrival_counters`); the
program that arrives last sums the partials in program order p_lo, p_lo + 1, ... (the same
bits whichever program finishes last), runs the epilogue and resets the counter to 0.

Rows: one M tile (num_rows <= BLOCK_M, decode buckets of at most 64 rows). Numerics: as the
split-K kernel of `linear_triton` (float32 partials summed in a fixed order, rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backends import MAX_ARRIVAL_COUNTERS, arrival_counters
from kernels.linear_triton import _epilogue


@triton.jit
def _program_of(unit, num_units, num_programs):
    """The program whose range [p U / P, (p + 1) U / P) holds `unit`."""
    return ((unit + 1) * num_programs - 1) // num_units


@triton.jit
def _finish(acc, acc_up, sum_squares, residual_ptr, residual_stride, rows, cols, row_ok,
            col_ok, K, eps, bias_ptr, out_ptr, out_stride, HAS_BIAS: tl.constexpr,
            NORM: tl.constexpr, GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """A finished tile's epilogue, with its residual tile loaded first when there is one."""
    residual = acc
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows.to(tl.int64)[:, None] * residual_stride
                           + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    _epilogue(acc, acc_up, sum_squares, residual, rows, cols, row_ok, col_ok, K, eps, bias_ptr,
              out_ptr, out_stride, HAS_BIAS, NORM, GATED, HAS_RESIDUAL)


@triton.jit
def _stream_k_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, partial_ptr, counter_ptr,
                     M, N, K, x_stride, w_stride, residual_stride, out_stride, eps,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr, SS_CHUNK: tl.constexpr,
                     SS_CHUNKS: tl.constexpr, MAX_PARTS: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    k_iters = tl.cdiv(K, BLOCK_K)
    num_units = tl.cdiv(N, BLOCK_N) * k_iters
    start = pid * num_units // num_programs
    end = (pid + 1) * num_units // num_programs
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    sum_squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:   # the rows' sums of squares over all of K, once per program
        for chunk in tl.static_range(SS_CHUNKS):
            kk = chunk * SS_CHUNK + tl.arange(0, SS_CHUNK)
            xs = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + kk[None, :],
                         mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            sum_squares += tl.sum(xs * xs, axis=1)
    up_offset = N.to(tl.int64) * w_stride    # GATED: the up rows follow the N gate rows
    tile_size = BLOCK_M * BLOCK_N
    partial_up = num_programs * 2 * tile_size    # GATED: the up partials after the gate ones
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    segment_start = start                    # first unit of the tile segment in progress
    for unit in range(start, end):
        tile = unit // k_iters
        k = (unit - tile * k_iters) * BLOCK_K
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + (k + ks)[None, :]
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_stride + (k + ks)[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & ((k + ks) < K)[None, :], other=0.0)
        w_mask = col_ok[:, None] & ((k + ks) < K)[None, :]
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            if EVEN_N and EVEN_K:
                w_up = tl.load(w_ptrs + up_offset)
            else:
                w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
        tile_end = (tile + 1) * k_iters
        if (unit == tile_end - 1) | (unit == end - 1):   # the segment ends: flush it
            if (segment_start == tile * k_iters) & (unit == tile_end - 1):   # whole tile
                _finish(acc, acc_up, sum_squares, residual_ptr, residual_stride, rows, cols,
                        row_ok, col_ok, K, eps, bias_ptr, out_ptr, out_stride, HAS_BIAS,
                        NORM, GATED, HAS_RESIDUAL)
            else:
                offsets = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                slot = pid * 2 + (segment_start != start).to(tl.int32)
                tl.store(partial_ptr + slot * tile_size + offsets, acc)
                if GATED:
                    tl.store(partial_ptr + partial_up + slot * tile_size + offsets, acc_up)
                tl.debug_barrier()   # the whole partial is written before the arrival counts
                p_lo = _program_of(tile * k_iters, num_units, num_programs)
                p_hi = _program_of(tile_end - 1, num_units, num_programs)
                arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == p_hi - p_lo:   # the last of the tile's programs: sum, in order
                    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for i in tl.static_range(MAX_PARTS):   # unrolled: keeps the loop flat
                        p = p_lo + i
                        # slot 0 where this tile is p's first, else 1 (only p_lo's can be)
                        first_tile = (p * num_units // num_programs) // k_iters
                        other = p * 2 + (first_tile != tile).to(tl.int32)
                        mine = (p + 0 * offsets) <= p_hi            # [BM, BN]
                        total += tl.load(partial_ptr + other * tile_size + offsets, mask=mine,
                                         other=0.0, cache_modifier=".cg")
                        if GATED:
                            total_up += tl.load(partial_ptr + partial_up + other * tile_size
                                                + offsets, mask=mine, other=0.0,
                                                cache_modifier=".cg")
                    _finish(total, total_up, sum_squares, residual_ptr, residual_stride, rows,
                            cols, row_ok, col_ok, K, eps, bias_ptr, out_ptr, out_stride,
                            HAS_BIAS, NORM, GATED, HAS_RESIDUAL)
                    tl.atomic_xchg(counter_ptr + tile, 0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            segment_start = unit + 1


def stream_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor, *, programs: int, block_m: int, norm_eps: float | None,
                    gated: bool, residual: torch.Tensor | None, ss_chunk: int,
                    config: dict) -> torch.Tensor:
    """Launch the Stream-K skinny GEMM (`linear_triton.linear` validates and calls this).

    Args:
        x: [M, K] with M <= block_m, unit stride on the last dim; weight: [N, K] contiguous
            ([2 N, K] when gated); bias: [N] or None; out: [M, N] (the residual when given).
        programs: persistent programs P (clamped to the unit count U, so each has >= 1 unit).
        block_m, norm_eps, gated, residual, ss_chunk: as the split-K kernel.
        config: BLOCK_N, BLOCK_K, num_warps, num_stages.
    Returns:
        out.
    Raises:
        ValueError: more output tiles than arrival counters, or more rows than block_m.
    """
    num_rows, in_features = x.shape
    out_features = out.shape[1]
    if num_rows > block_m:
        raise ValueError(f"the Stream-K skinny GEMM takes one row tile: {num_rows} rows > "
                         f"{block_m}")
    tiles = triton.cdiv(out_features, config["BLOCK_N"])
    if tiles > MAX_ARRIVAL_COUNTERS:
        raise ValueError(f"{tiles} output tiles exceed the {MAX_ARRIVAL_COUNTERS} arrival "
                         "counters; use larger tiles")
    k_iters = triton.cdiv(in_features, config["BLOCK_K"])
    units = tiles * k_iters
    programs = max(1, min(programs, units))
    # programs sharing one tile at most: k_iters over the fewest units a program gets, + 1
    max_parts = -(-k_iters // (units // programs)) + 1
    partial = torch.empty((2 if gated else 1) * programs * 2 * block_m * config["BLOCK_N"],
                          dtype=torch.float32, device=x.device)
    _stream_k_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, out, out, partial,
        arrival_counters(x.device), num_rows, out_features, in_features, x.stride(0),
        weight.stride(0), out.stride(0), out.stride(0), 0.0 if norm_eps is None else norm_eps,
        HAS_BIAS=bias is not None, NORM=norm_eps is not None, GATED=gated,
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m,
        EVEN_N=out_features % config["BLOCK_N"] == 0,
        EVEN_K=in_features % config["BLOCK_K"] == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SS_CHUNK=ss_chunk,
        SS_CHUNKS=triton.cdiv(in_features, ss_chunk) if norm_eps else 0,
        MAX_PARTS=min(max_parts, programs), **config)
    return out
