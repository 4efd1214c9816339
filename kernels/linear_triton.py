"""Skinny GEMM in Triton for decode: `y = x @ weight.T (+ bias)` with few rows of x (the
"triton" path of `kernels/linear.py`).

At decode a linear layer reads its whole weight to multiply a handful of rows, so its time is
weight bytes over memory bandwidth. cuBLAS runs the Llama-3-8B decode GEMVs at 3.0-4.1 TB/s on
an H200 (copy bandwidth 4.27) and splits K on some shapes, adding a reduce kernel per call.

Design: program (n tile, m tile, k split) streams a [BLOCK_N, K / SPLIT_K] slab of the weight
in [BLOCK_N, BLOCK_K] tiles, software-pipelined `num_stages` deep, and multiplies each with
`tl.dot` against a [BLOCK_M, BLOCK_K] tile of x (rows past M masked). SPLIT_K = 1: each output
element is one program's float32 sum, rounded once. SPLIT_K > 1 (more programs for short
weights, fewer x rows re-read per weight byte at 64 rows): each split stores its float32 partial
tile, then counts itself in on a per-tile arrival counter; the split that arrives last sums the
SPLIT_K partials in split order (0, 1, ...) and writes the output, so the result is the same
whichever split finishes last (deterministic), with no reduce kernel; it resets the counter to 0
for the next call. The counters are one int32 per output tile (`kernels.backends.
arrival_counters`), zero between calls; calls on one stream run one after another, so they
share them.

Operand order: by default the tile product is x @ w^T ([BLOCK_M, BLOCK_N]); at 16 rows Triton
then runs mma.sync with the weight tile moved from shared memory through registers. SWAP_AB
computes the transposed tile w @ x^T ([BLOCK_N, BLOCK_M]), so a weight tile of 64+ rows is the
A operand of a Hopper wgmma read straight from shared memory (x^T, BLOCK_M wide, is its B), and
transposes the accumulator once before the epilogue. On the H200 this took the fused decode
boundaries from 152.2 to 147.0 us (o -> gate_up) and 100.7 to 95.7 us (down -> qkv) at 1 + 16
rows (benchmarks/RESULTS.md run 13); at 64 rows the sweep kept the x @ w^T order for most
shapes. The sweep picks the order per shape.

Where it runs: only for (row bucket, out_features, in_features) shapes that a sweep on this
device found faster than cuBLAS inside a CUDA graph (`benchmarks/gemv_sweep.py` writes
`kernels/configs/skinny_linear_<device name>.json` with the best tile config per shape);
`tuned_config` returns None for every other shape and device, and the caller uses cuBLAS.

Sums of squares handed over (`sum_squares_out` -> `sum_squares`): a residual GEMM can write, per
output tile, its new residual rows' sums of squares; the next norm GEMM (RMSNorm of that
residual) then sums those [N tiles, M] partials, loaded before its K loop and summed after it,
instead of a pre-pass over x (up to 16 rows per program) or an x x^T dot per K step (from 32).
H200, Llama-3-8B decode in one process (benchmarks/RESULTS.md run 16): +1.0% / +3.7% / +2.0%
tokens/s at batch 1 / 8 / 64.

Launch: on Hopper with programmatic dependent launch (`kernels/pdl.py`): each program waits
for the previous kernel before it reads x and releases the next kernel after its K loop, so the
next launch overlaps this kernel's epilogue (H200 decode, benchmarks/RESULTS.md run 14: +1.5%
at batch 1, +2.0% at 64).

Row argmax (`linear_row_argmax`, the greedy LM head): the epilogue also writes each tile's row
maxima of the rounded output and their first columns ([N tiles, M]); one small kernel picks
each row's first maximal tile. This replaces the argmax's passes over the logits (at 64 rows
two torch reductions, ~17 us per step on an H200; benchmarks/RESULTS.md run 18).

Gluon: for the row buckets in `KernelConfig.gluon_block_m` (64 rows) on Hopper, `linear` runs
`kernels/linear_gluon.py`'s kernel instead, on the same tile config and buffers: it requests the
weight's first tiles by TMA before the PDL wait (+2.5-3.6% at batch 64, run 18).

Numerics: float32 accumulation of bf16/fp16 products; vs F.linear (cuBLAS) the summation order
differs: relative error ~1e-3 in bf16. float32 inputs use IEEE dot products (no tf32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.backends import MAX_ARRIVAL_COUNTERS, arrival_counters, tuned_table
from deepinfer.kernels.settings import DEFAULT, KernelConfig

CONFIG_KIND = "skinny_linear"   # kernels/configs/skinny_linear_<device name>.json


@triton.jit
def _epilogue(acc, acc_up, sum_squares, residual, rows, cols, row_ok, col_ok, K, eps, bias_ptr,
              out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, M, pid_n,
              HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, EMIT_SS: tl.constexpr, EMIT_ARGMAX: tl.constexpr):
    """Scale by the rows' inverse RMS (NORM), add the bias, apply SiLU(gate) * up (GATED) or
    add the residual (HAS_RESIDUAL), round to the output dtype and store one [BM, BN] tile.
    EMIT_SS: also store the tile's row sums of squares of the rounded output (float32) as row
    pid_n of the [N tiles, M] partials at ss_ptr. EMIT_ARGMAX: also store each row's maximum
    of the rounded tile (float32) and its first column (int32) as row pid_n of the [N tiles, M]
    maxima at max_ptr / argmax_ptr."""
    dtype = out_ptr.dtype.element_ty
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if NORM:
        inv_rms = tl.rsqrt(sum_squares / K + eps)[:, None]                    # [BM, 1]
        acc = acc * inv_rms
        if GATED:
            acc_up = acc_up * inv_rms
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:   # the rounding steps of elementwise_triton's silu_and_mul on rounded gate / up
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        result = silu * acc_up.to(dtype)
    elif HAS_RESIDUAL:   # as `y + residual` in the dtype: y rounded, the sum rounded once
        result = acc.to(dtype).to(tl.float32) + residual.to(tl.float32)
    else:
        result = acc
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, result.to(dtype), mask=tile_ok)
    if EMIT_SS:
        stored = tl.where(tile_ok, result.to(dtype).to(tl.float32), 0.0)
        tl.store(ss_ptr + pid_n * M + rows, tl.sum(stored * stored, axis=1), mask=row_ok)
    if EMIT_ARGMAX:
        _store_row_argmax(result.to(dtype).to(tl.float32), tile_ok, cols, max_ptr, argmax_ptr,
                          pid_n * M + rows, row_ok)


@triton.jit
def _store_row_argmax(values, tile_ok, cols, max_ptr, argmax_ptr, offsets, row_ok):
    """Store each row's maximum of the [BM, BN] `values` and the first of its columns `cols`
    ([BN]) holding it; NaN counts as +inf (torch.argmax takes NaN as the maximum)."""
    key = tl.where(tile_ok, values, float("-inf"))
    key = tl.where(key != key, float("inf"), key)
    best = tl.max(key, axis=1)
    first = tl.min(tl.where(key == best[:, None], cols[None, :], 2147483647), axis=1)
    tl.store(max_ptr + offsets, best, mask=row_ok)
    tl.store(argmax_ptr + offsets, first, mask=row_ok)


@triton.jit
def _first_maximal_column_kernel(max_ptr, argmax_ptr, out_ptr, M, TILES: tl.constexpr,
                                 BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    pdl.wait_and_release(PDL, True)
    tile = tl.arange(0, BLOCK_T)
    best = tl.load(max_ptr + tile * M + row, mask=tile < TILES, other=float("-inf"))
    first = tl.min(tl.where(best == tl.max(best, axis=0), tile, BLOCK_T), axis=0)
    tl.store(out_ptr + row, tl.load(argmax_ptr + first * M + row).to(tl.int64))


@triton.jit
def _mma(x, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ w.T ([BM, BN]), or with SWAP_AB its transpose acc + w @ x.T ([BN, BM])."""
    if SWAP_AB:
        out = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        out = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return out


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, partial_ptr,
                          counter_ptr, ss_ptr, max_ptr, argmax_ptr, M, N, K, k_per_split,
                          x_stride, w_stride, residual_stride, out_stride, eps,
                          HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                          PRECISION: tl.constexpr, NORM_BY_DOT: tl.constexpr,
                          SS_CHUNK: tl.constexpr, SS_CHUNKS: tl.constexpr,
                          SWAP_AB: tl.constexpr, SS_PARTS: tl.constexpr,
                          SS_PARTS_P2: tl.constexpr, EMIT_SS: tl.constexpr,
                          EMIT_ARGMAX: tl.constexpr, PDL: tl.constexpr,
                          TRIGGER_AFTER_LOOP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split            # a multiple of BLOCK_K: splits never overlap
    k_end = tl.minimum(k_start + k_per_split, K)
    ks = k_start + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + ks[None, :]      # [BM, BK]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]      # [BN, BK]
    up_offset = N.to(tl.int64) * w_stride    # GATED: the up rows follow the N gate rows
    # x, the residual, the partials and the counters: after the previous kernel
    pdl.wait_and_release(PDL, not TRIGGER_AFTER_LOOP)
    if SWAP_AB:   # acc^T = W x^T: the weight tile is the MMA's A operand, from shared memory
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    residual = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_RESIDUAL:   # loaded now, so its latency is not added after the K loop
        residual = tl.load(residual_ptr + rows.to(tl.int64)[:, None] * residual_stride
                           + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    gram = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)   # NORM_BY_DOT: x x^T
    ss_parts = tl.zeros((SS_PARTS_P2, BLOCK_M), dtype=tl.float32)
    if SS_PARTS > 0:   # the producer's per-tile sums of squares: loaded now, summed after the loop
        part = tl.arange(0, SS_PARTS_P2)
        ss_parts = tl.load(ss_ptr + part[:, None] * M + rows[None, :],
                           mask=(part < SS_PARTS)[:, None] & row_ok[None, :], other=0.0)
    elif NORM and not NORM_BY_DOT:   # sums of squares first, in SS_CHUNKS unrolled wide loads
        for chunk in tl.static_range(SS_CHUNKS):
            kk = chunk * SS_CHUNK + tl.arange(0, SS_CHUNK)
            xs = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + kk[None, :],
                         mask=row_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            sum_squares += tl.sum(xs * xs, axis=1)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & ((k - k_start + ks) < K)[None, :],
                        other=0.0)
        w_mask = col_ok[:, None] & ((k - k_start + ks) < K)[None, :]
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = _mma(x, w, acc, SWAP_AB, PRECISION)
        if GATED:
            if EVEN_N and EVEN_K:
                w_up = tl.load(w_ptrs + up_offset)
            else:
                w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            acc_up = _mma(x, w_up, acc_up, SWAP_AB, PRECISION)
        if NORM and NORM_BY_DOT and SS_PARTS == 0:   # the sums of squares: one more dot on x
            gram = tl.dot(x, tl.trans(x), gram, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if TRIGGER_AFTER_LOOP:
        pdl.launch_dependents(PDL)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if SS_PARTS > 0:
        sum_squares = tl.sum(ss_parts, axis=0)
    elif NORM and NORM_BY_DOT:
        diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
        sum_squares = tl.sum(tl.where(diagonal, gram, 0.0), axis=1)
    if SPLIT_K > 1:   # (NORM and GATED need one split: the launcher checks)
        tile_ok = row_ok[:, None] & col_ok[None, :]
        tile_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]          # [BM, BN]
        tl.store(partial_ptr + pid_k * M * N + tile_offsets, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:   # the last split of this tile: sum all, in split order
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(partial_ptr + split * M * N + tile_offsets, mask=tile_ok,
                               other=0.0, cache_modifier=".cg")
            _epilogue(acc, acc_up, sum_squares, residual, rows, cols, row_ok, col_ok, K, eps,
                      bias_ptr, out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, M, pid_n,
                      HAS_BIAS, NORM, GATED, HAS_RESIDUAL, EMIT_SS, EMIT_ARGMAX)
            tl.atomic_xchg(counter, 0)
    else:
        _epilogue(acc, acc_up, sum_squares, residual, rows, cols, row_ok, col_ok, K, eps,
                  bias_ptr, out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, M, pid_n,
                  HAS_BIAS, NORM, GATED, HAS_RESIDUAL, EMIT_SS, EMIT_ARGMAX)


def block_m(num_rows: int) -> int:
    """Rows per program: the smallest tl.dot tile (16) up to 64."""
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64


def invariant_config(weight: torch.Tensor) -> dict:
    """The launch config of the batch-invariant mode (`KernelConfig.batch_invariant`): a
    function of the weight's shape only, never of M, and one K split, so each output element
    is one program's float32 sum over K in BLOCK_K steps, in order, whatever the rows beside
    it: 64-row tiles for every M (decode pads its rows; prefill-sized M tiles), BLOCK_N from
    the output features so that a decode step still has ~100+ programs on an 8B model's
    linears; float32 weights (IEEE dots, no tensor cores) 16 x 16 or 16 x 32 tiles."""
    out_features = weight.shape[0]
    if weight.dtype == torch.float32:   # IEEE dots on the CUDA cores (a MoE router's logits):
        # 16-row tiles, or a decode step pays 64 rows of FMAs for one
        return {"BLOCK_M": 16, "BLOCK_N": 16 if out_features <= 4096 else 32, "BLOCK_K": 64,
                "SPLIT_K": 1, "SWAP_AB": False, "num_warps": 4, "num_stages": 3}
    block_n = 128 if out_features >= 16384 else 64 if out_features >= 8192 else 32
    # 128-wide K steps: at one row a program is bound by the weight bytes it has in flight
    return {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": 1, "SWAP_AB": False,
            "num_warps": 4, "num_stages": 4}


def skinny_table(entries) -> dict[tuple[int, int, int], dict]:
    """{(block_m, out_features, in_features): launch config} of the `skinny_linear` config-file
    entries where the sweep found this kernel faster than cuBLAS."""
    return {(e["block_m"], e["out_features"], e["in_features"]): e["config"]
            for e in entries if e["triton_faster"]}


def tuned_config(num_rows: int, weight: torch.Tensor) -> dict | None:
    """The tuned launch config for x of `num_rows` rows times `weight` [N, K] on weight's CUDA
    device, or None (the caller falls back to cuBLAS) where cuBLAS was as fast, the shape was
    not swept, or the device has no config file."""
    table = tuned_table(CONFIG_KIND, weight.device, skinny_table)
    return table.get((block_m(num_rows), *weight.shape))


def num_partials(out_features: int, config: dict) -> int:
    """Rows of a residual GEMM's `sum_squares_out`: its output tiles along N."""
    return triton.cdiv(out_features, config["BLOCK_N"])


def _sum_squares_arg(num_rows: int, out_features: int, config: dict, norm_eps, residual,
                     sum_squares, sum_squares_out) -> tuple[torch.Tensor | None, int]:
    """Check `linear`'s sum_squares / sum_squares_out: (the tensor or None, SS_PARTS: the
    partials summed by the norm, 0 if none)."""
    if sum_squares is not None and sum_squares_out is not None:
        raise ValueError("give sum_squares (a norm's input) or sum_squares_out (a residual "
                         "GEMM's output), not both")
    given = sum_squares if sum_squares is not None else sum_squares_out
    if given is None:
        return None, 0
    if sum_squares is not None and norm_eps is None:
        raise ValueError("sum_squares feeds the norm: pass norm_eps too")
    if sum_squares_out is not None and residual is None:
        raise ValueError("sum_squares_out sums the new residual rows: pass residual too")
    parts = given.shape[0] if sum_squares is not None else num_partials(out_features, config)
    if (given.dtype != torch.float32 or not given.is_contiguous()
            or tuple(given.shape) != (parts, num_rows)):
        raise ValueError(f"sums of squares must be a contiguous float32 [{parts}, {num_rows}] "
                         f"tensor, got {given.dtype} {tuple(given.shape)}")
    return given, parts if sum_squares is not None else 0


def _row_maxima_args(num_rows: int, out_features: int, config: dict, row_maxima_out,
                     out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check `linear`'s row_maxima_out: the (maxima, columns) pointers (out's where None)."""
    if row_maxima_out is None:
        return out, out
    shape = (num_partials(out_features, config), num_rows)
    maxima, columns = row_maxima_out
    if (maxima.dtype != torch.float32 or columns.dtype != torch.int32
            or tuple(maxima.shape) != shape or tuple(columns.shape) != shape
            or not (maxima.is_contiguous() and columns.is_contiguous())):
        raise ValueError(f"row maxima must be contiguous float32 and int32 {list(shape)} tensors")
    return maxima, columns


def linear_row_argmax(x: torch.Tensor, weight: torch.Tensor, *, config: dict,
                      settings: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear(x, weight, config=config)` and each row's first maximal column, the argmax taken
    in the GEMM's epilogue (a greedy LM head: no logits re-read by an argmax kernel).

    Returns:
        (out [M, N] in x's dtype, [M] int64: `out.argmax(dim=-1)`, ties to the lowest column;
        NaN counts as the maximum, but a row holding both NaN and +inf may get either).
    """
    shape = (num_partials(weight.shape[0], config), x.shape[0])
    maxima = torch.empty(shape, dtype=torch.float32, device=x.device)
    columns = torch.empty(shape, dtype=torch.int32, device=x.device)
    out = linear(x, weight, config=config, row_maxima_out=(maxima, columns), settings=settings)
    return out, first_maximal_column(maxima, columns, settings=settings)


def first_maximal_column(maxima: torch.Tensor, columns: torch.Tensor, *,
                         settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """[T, M] per-tile row maxima (float32) and their columns (int32), tiles in column order ->
    [M] int64: the column of each row's maximum over all tiles, the first tile's on ties."""
    tiles, num_rows = maxima.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=maxima.device)
    if num_rows:
        pdl_options = pdl.launch_options(maxima.device, settings)
        _first_maximal_column_kernel[(num_rows,)](
            maxima, columns, out, num_rows, TILES=tiles, BLOCK_T=triton.next_power_of_2(tiles),
            PDL=bool(pdl_options), **pdl_options)
    return out


# `KernelConfig.norm_by_dot_rows` (32): from this many rows per program the norm's sums of
# squares come from tl.dot(x, x.T) in the K loop, below it from a pre-pass over x (H200,
# Llama-3-8B qkv: pre-pass 36.2 us at 1 + 16 rows against 46.5 by dot; at 64 rows 40.3 against
# 19.6; benchmarks/RESULTS.md run 12). `KernelConfig.gluon_block_m` ({64}): the row buckets whose
# bf16 / fp16 GEMMs run `kernels/linear_gluon.py` on a Hopper GPU (the same tiles, the weight's
# first tiles requested before the PDL wait).


@functools.cache
def _gluon_device(device: torch.device) -> bool:
    """A Hopper GPU, and a Triton whose Gluon has the API `kernels/linear_gluon.py` uses."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        from deepinfer.kernels import linear_gluon  # noqa: F401
    except ImportError:
        return False
    return True


def _gluon_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Gluon kernel runs this call: a Gluon device and TMA-aligned operands."""
    if not _gluon_device(x.device):
        return False
    from deepinfer.kernels import linear_gluon

    return linear_gluon.usable(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: dict, norm_eps: float | None = None, gated: bool = False,
           residual: torch.Tensor | None = None, sum_squares: torch.Tensor | None = None,
           sum_squares_out: torch.Tensor | None = None,
           row_maxima_out: tuple[torch.Tensor, torch.Tensor] | None = None,
           settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`x @ weight.T + bias`, optionally with x RMS-normalised, SiLU-gated or a residual added.

    Args:
        x: [M, in_features], weight's dtype, unit stride on the last dim.
        weight: [out_features, in_features], contiguous ([2 I, in_features] when gated: the
            I gate rows, then the I up rows).
        bias: [out_features] or None (None when gated).
        config: launch parameters BLOCK_N, BLOCK_K, num_warps, num_stages and optionally
            SPLIT_K (default 1), SWAP_AB (default False: compute the transposed tile
            W x^T, the weight tile as the MMA's A operand) (`tuned_config`) and BLOCK_M
            (default `block_m(M)`; fixed by the batch-invariant mode, `invariant_config`,
            which then never runs the Gluon kernel).
        norm_eps: if given, compute `(x / rms(x)) @ weight.T`, rms(x) = sqrt(mean(x^2) + eps)
            over each row of x (RMSNorm with a unit weight: fold the norm weight into `weight`
            first). The rows' sums of squares come from a pre-pass over x (unrolled wide
            loads) or, from `settings.norm_by_dot_rows` rows per program, from the diagonal of x x^T, one
            more tl.dot per K step on the x tile already loaded (an elementwise use of that
            tile halved the GEMM's speed); the epilogue scales the accumulator. Needs one K
            split.
        gated: compute `silu(x @ gate.T) * (x @ up.T)` ([M, I]) with gate / up the two row
            halves of weight, rounded as `kernels.activation.silu_and_mul` on the rounded
            halves. Needs one K split and no bias.
        residual: [M, out_features] of x's dtype, unit stride on the last dim, or None: if
            given, the result `residual + x @ weight.T (+ bias)` (the product rounded to the
            dtype first, the sum rounded once) is written into `residual` in place and
            `residual` is returned.
        sum_squares: with norm_eps, [P, M] float32 contiguous partial sums of squares of x's
            rows (row m's is the sum over the P partials, in order), e.g. a residual GEMM's
            `sum_squares_out`: the norm then reads them instead of x's rows (no pre-pass, no
            x x^T dot).
        sum_squares_out: with residual, [num_partials(out_features, config), M] float32
            contiguous, written with each output tile's row sums of squares of the new
            (rounded) residual, for the next norm's `sum_squares`.
        row_maxima_out: (maxima, columns), each [num_partials(out_features, config), M]
            contiguous, float32 and int32: written with each output tile's row maxima of the
            rounded output and the first column holding each (`linear_row_argmax`).
        settings: the kernel choices (`KernelConfig`: Gluon row buckets, PDL, the norm's sums
            of squares by dot).
    Returns:
        [M, out_features] ([M, I] when gated), x's dtype.
    Raises:
        ValueError: norm_eps or gated with SPLIT_K > 1, gated with a bias, too many output
            tiles for the split-K arrival counters, sum_squares / sum_squares_out without
            norm_eps / residual or of the wrong shape or dtype, or row_maxima_out of the wrong
            shapes or dtypes.
    """
    out_features, in_features = weight.shape
    if gated:
        if bias is not None:
            raise ValueError("the gated skinny GEMM takes no bias")
        out_features //= 2
    num_rows = x.shape[0]
    if residual is not None:
        out = residual
    else:
        out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    config = dict(config)
    split_k = config.pop("SPLIT_K", 1)
    swap_ab = config.pop("SWAP_AB", False)
    if split_k > 1 and (norm_eps is not None or gated):
        raise ValueError("norm_eps and gated need SPLIT_K=1 (each program must see all of K)")
    ss_ptr, ss_parts = _sum_squares_arg(num_rows, out_features, config, norm_eps, residual,
                                        sum_squares, sum_squares_out)
    config = dict(config)
    fixed_block_m = config.pop("BLOCK_M", None)
    rows_per_program = fixed_block_m or block_m(num_rows)
    gluon = (fixed_block_m is None and rows_per_program in settings.gluon_block_m
             and (norm_eps is None or ss_parts) and config["BLOCK_N"] % 64 == 0
             and _gluon_takes(x, weight))
    block_k = config["BLOCK_K"]
    # K per split, a multiple of BLOCK_K; trailing splits may get no tiles (they add zeros)
    k_per_split = triton.cdiv(in_features, split_k * block_k) * block_k
    # the norm's pre-pass loads [rows_per_program, ss_chunk] tiles of 4K elements (32 float32
    # registers per thread at 4 warps: 16K-element tiles measured ~4.5 us slower per call)
    ss_chunk = min(triton.next_power_of_2(in_features), (1 << 12) // rows_per_program)
    grid = (triton.cdiv(out_features, config["BLOCK_N"]), triton.cdiv(num_rows, rows_per_program),
            split_k)
    if split_k > 1:
        if grid[0] * grid[1] > MAX_ARRIVAL_COUNTERS:
            raise ValueError(f"{grid[0] * grid[1]} output tiles exceed the "
                             f"{MAX_ARRIVAL_COUNTERS} arrival counters of the split-K skinny "
                             "GEMM; use SPLIT_K=1 or larger tiles")
        partial = torch.empty((split_k, num_rows, out_features), dtype=torch.float32,
                              device=x.device)   # [SPLIT_K, M, N] float32 partial sums
        counters = arrival_counters(x.device)
    else:
        partial = counters = out   # unused
    maxima, columns = _row_maxima_args(num_rows, out_features, config, row_maxima_out, out)
    pdl_options = pdl.launch_options(x.device, settings)
    if gluon:
        from deepinfer.kernels import linear_gluon

        linear_gluon.launch(x, weight, bias, out, partial, counters,
                            out if ss_ptr is None else ss_ptr, ss_parts,
                            block_m=rows_per_program, block_n=config["BLOCK_N"],
                            split_k=split_k, norm_eps=norm_eps,
                            gated=gated, residual=residual,
                            emit_ss=sum_squares_out is not None, maxima=maxima,
                            columns=columns, emit_argmax=row_maxima_out is not None,
                            pdl_options=pdl_options, settings=settings)
        return out
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, out, partial, counters,
        out if ss_ptr is None else ss_ptr, maxima, columns, num_rows,
        out_features, in_features, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        out.stride(0), 0.0 if norm_eps is None else norm_eps, HAS_BIAS=bias is not None,
        NORM=norm_eps is not None, GATED=gated, HAS_RESIDUAL=residual is not None,
        BLOCK_M=rows_per_program, SPLIT_K=split_k,
        EVEN_N=out_features % config["BLOCK_N"] == 0, EVEN_K=in_features % block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        NORM_BY_DOT=rows_per_program >= settings.norm_by_dot_rows, SS_CHUNK=ss_chunk,
        SS_CHUNKS=triton.cdiv(in_features, ss_chunk) if norm_eps and not ss_parts else 0,
        SWAP_AB=swap_ab, SS_PARTS=ss_parts, SS_PARTS_P2=triton.next_power_of_2(max(ss_parts, 1)),
        EMIT_SS=sum_squares_out is not None, EMIT_ARGMAX=row_maxima_out is not None,
        PDL=bool(pdl_options),
        TRIGGER_AFTER_LOOP=pdl.release_after_loop("linear", settings=settings),
        **pdl_options, **config)
    return out
