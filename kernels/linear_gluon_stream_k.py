"""Stream-K for the Gluon skinny GEMM: every SM streams the same number of weight bytes.

`kernels/linear_gluon.py` runs one program per output tile (and K split), one program per SM
(192 KiB of stages). One program streams its weight at most ~50 GB/s (H200,
benchmarks/gluon_grid_sweep.py), so a grid with fewer programs than SMs, or a last wave that
leaves SMs idle, cannot reach the HBM rate: Llama-3-8B at 64 rows has 96 qkv programs, 128 o and
down programs (64 tiles x 2 splits) and 224 gate_up programs (1.7 waves) on 132 SMs.

Stream-K (Osama, Merrill, Cecka, Garland, Owens, "Stream-K: Work-centric Parallel
Decomposition for Dense Matrix-Matrix Multiplication on the GPU", PPoPP 2023) cuts the GEMM's
iteration space instead of its output: the tiles' K steps laid end to end (tile-major, a step
= `sub_boxes` * BOX_K columns of K) are split into equal contiguous runs, one per SM. Program p
takes steps [p * per_program, (p + 1) * per_program); its weight pipeline runs straight
through tile boundaries. Where a run ends a tile's steps:
- a tile whose steps one program covers entirely gets the epilogue from that program;
- otherwise each covering program stores its float32 partial tile (slot 0 for the segment its
  run starts with, slot 1 for the one it ends with) and counts itself in on the tile's
  arrival counter; the last to arrive sums the covering programs' partials in program order
  (deterministic whichever finishes last), runs the epilogue and resets the counter.
The epilogue is `linear_gluon._epilogue` (norm scale from handed-over sums of squares, bias,
SiLU gate, residual add, sums of squares out); the row argmax (the LM head) is not offered.

A run that starts inside a tile and goes on past it holds that segment's sums in registers and
finishes it after the run (a guess that the arrival's release fence drained the copies in
flight mid-run; the version that finished it at once measured the same, run 20).

Measured (H200, benchmarks/gluon_grid_sweep.py, us per call against one program per tile in
the same process; benchmarks/RESULTS.md run 20): slower on every Llama-3-8B shape at 64 rows:
qkv 23.4 against 18.0, o 14.7 / 13.8, gate_up 74.0 / 63.1, down 42.4 / 35.0; b=64 decode
10771-11592 tok/s against 13016-13190 with it off. Runs at scattered K offsets lose most: o's
runs are exact half tiles (+0.9 us) and so are down's on 128 programs (36.5 / 35.0); qkv on
one whole tile per program matches the per-tile kernel (17.0 / 18.0). With a quarter of the x
bytes (16 rows) the loss shrinks (qkv 17.8 / 15.7, down 36.1 / 33.0), which fits this
reading: where every program reads the same x tile at about the same time one copy in L2
serves all, while runs at scattered K offsets read each x tile at different times, after the
weight stream may have evicted it. Not explained: down on one whole tile per program (64
programs, aligned) took 43.7 and 39.1 us in two calls, against 34.8 per tile (an earlier
call). So ENABLED is False. Next: TMA loads with an L2 eviction policy (evict-first weights,
evict-last x): newer Triton's Gluon `async_load` takes a `cache_policy` (3.9 does; the device
runs 3.6).

Numerics: float32 accumulation of bf16 products, partial tiles summed in float32, one rounding;
the split points depend on N, K and the SM count, not on M, so rows of a 64-row bucket give
the same bits whatever the batch (tests/kernels/test_linear_gluon.py).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

from deepinfer.kernels import pdl
from deepinfer.kernels.backends import MAX_ARRIVAL_COUNTERS, num_sms
from deepinfer.kernels.linear_gluon import (BOX_K, _epilogue, _gdc_launch_dependents,
                                  _gdc_wait, _handed_over_sum_squares, _load_stage,
                                  _multiply_stage, _stage_ring, _thread_barrier, descriptors,
                                  stages_for, sub_boxes)

# Off: slower than one program per tile on every Llama-3-8B shape (see above); tests and
# benchmarks switch it on
ENABLED = False
# programs to split the steps over; None: the GPU's SM count (tests set a few)
PROGRAMS: int | None = None


@gluon.jit
def _step_coords(step, k_steps, N, BLOCK_N: gl.constexpr, BK: gl.constexpr):
    """(first weight row, first up row, first K column) of global step `step`."""
    n0 = (step // k_steps) * BLOCK_N
    return n0, N + n0, (step % k_steps) * BK


@gluon.jit
def _tile_epilogue(acc, acc_up, tile, local, rows, sum_squares, bias_ptr, residual_ptr,
                   out_ptr, ss_ptr, M, N, K, residual_stride, out_stride, eps,
                   BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, NORM: gl.constexpr,
                   GATED: gl.constexpr, HAS_RESIDUAL: gl.constexpr, EMIT_SS: gl.constexpr):
    """`linear_gluon._epilogue` on tile `tile`'s summed accumulators ([BLOCK_N, BM] float32)."""
    cols = tile * BLOCK_N + local
    tile_ok = gl.expand_dims(cols < N, 1) & gl.expand_dims(rows < M, 0)
    residual = gl.zeros_like(acc)
    if HAS_RESIDUAL:
        residual = gl.load(residual_ptr + gl.expand_dims(rows.to(gl.int64), 0) * residual_stride
                           + gl.expand_dims(cols, 1), mask=tile_ok, other=0.0).to(gl.float32)
    _epilogue(acc, acc_up, sum_squares, residual, rows, cols, tile_ok, N, K, eps, bias_ptr,
              out_ptr, out_stride, ss_ptr, ss_ptr, ss_ptr, M, tile, HAS_BIAS, NORM, GATED,
              HAS_RESIDUAL, EMIT_SS, False)


@gluon.jit
def _finish_segment(acc, acc_up, step, start, pid, per_program, k_steps, local, rows,
                    part_offsets, sum_squares, bias_ptr, residual_ptr, out_ptr, partial_ptr,
                    counter_ptr, ss_ptr, M, N, K, residual_stride, out_stride, eps,
                    BLOCK_N: gl.constexpr, BM: gl.constexpr, HAS_BIAS: gl.constexpr,
                    NORM: gl.constexpr, GATED: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                    EMIT_SS: gl.constexpr):
    """This program's run ends tile `step // k_steps`'s steps at `step` (or ends there): the
    epilogue if the run covered the whole tile, else its partial and, if it arrives last, the
    epilogue of the tile's sum."""
    tile = step // k_steps
    tile_begin = tile * k_steps
    PARTS: gl.constexpr = 2 if GATED else 1
    TILE: gl.constexpr = BLOCK_N * BM
    if (start <= tile_begin) & (step == tile_begin + k_steps - 1):
        _tile_epilogue(acc, acc_up, tile, local, rows, sum_squares, bias_ptr, residual_ptr,
                       out_ptr, ss_ptr, M, N, K, residual_stride, out_stride, eps, BLOCK_N,
                       HAS_BIAS, NORM, GATED, HAS_RESIDUAL, EMIT_SS)
    else:
        slot = (pid * 2 + (start < tile_begin).to(gl.int32)) * PARTS
        gl.store(partial_ptr + slot * TILE + part_offsets, acc)
        if GATED:
            gl.store(partial_ptr + (slot + 1) * TILE + part_offsets, acc_up)
        _thread_barrier()   # every thread's partial is written before the arrival counts
        first = tile_begin // per_program
        last = (tile_begin + k_steps - 1) // per_program
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == last - first:   # the last to arrive: sum all, in program order
            _thread_barrier()
            total = gl.zeros_like(acc)
            total_up = gl.zeros_like(acc_up)
            for p in range(first, last + 1):
                other = (p * 2 + (p * per_program < tile_begin).to(gl.int32)) * PARTS
                total += gl.load(partial_ptr + other * TILE + part_offsets,
                                 cache_modifier=".cg")
                if GATED:
                    total_up += gl.load(partial_ptr + (other + 1) * TILE + part_offsets,
                                        cache_modifier=".cg")
            gl.atomic_xchg(counter_ptr + tile, 0)
            _tile_epilogue(total, total_up, tile, local, rows, sum_squares, bias_ptr,
                           residual_ptr, out_ptr, ss_ptr, M, N, K, residual_stride, out_stride,
                           eps, BLOCK_N, HAS_BIAS, NORM, GATED, HAS_RESIDUAL, EMIT_SS)


@gluon.jit
def _stream_k_kernel(w_desc, x_desc, bias_ptr, residual_ptr, out_ptr, partial_ptr, counter_ptr,
                     ss_ptr, M, N, K, k_steps, per_program, total_steps, residual_stride,
                     out_stride, eps,
                     HAS_BIAS: gl.constexpr, NORM: gl.constexpr, GATED: gl.constexpr,
                     HAS_RESIDUAL: gl.constexpr, EMIT_SS: gl.constexpr,
                     SS_PARTS: gl.constexpr, SS_PARTS_P2: gl.constexpr, STAGES: gl.constexpr,
                     SUB: gl.constexpr, PDL: gl.constexpr, TRIGGER_AFTER_LOOP: gl.constexpr,
                     num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BOX: gl.constexpr = w_desc.block_type.shape[1]   # K columns per TMA box (128 bytes)
    BK: gl.constexpr = BOX * SUB                      # K columns per step
    BM: gl.constexpr = x_desc.block_type.shape[0]
    pid = gl.program_id(0)
    start = pid * per_program
    num = gl.minimum(per_program, total_steps - start)

    w_smem, u_smem, x_smem, bars = _stage_ring(w_desc, x_desc, STAGES, SUB, GATED)
    w_bytes: gl.constexpr = w_desc.block_type.nbytes * (2 if GATED else 1)
    stage_bytes: gl.constexpr = SUB * (w_bytes + x_desc.block_type.nbytes)

    for st in gl.static_range(STAGES):      # the weights: written by no kernel
        n0, up_row, k = _step_coords(start + st, k_steps, N, BLOCK_N, BK)
        mbarrier.expect(bars.index(st), stage_bytes, pred=st < num)
        _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bars.index(st), st, n0, up_row, k,
                    st < num, SUB, GATED, True, False)
    _gdc_wait(PDL)                          # x, the residual, partials: the previous kernel's
    if not TRIGGER_AFTER_LOOP:
        _gdc_launch_dependents(PDL)
    for st in gl.static_range(STAGES):
        n0, up_row, k = _step_coords(start + st, k_steps, N, BLOCK_N, BK)
        _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bars.index(st), st, n0, up_row, k,
                    st < num, SUB, GATED, False, True)

    epi: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])
    local = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))            # [BN]
    rows = gl.arange(0, BM, layout=gl.SliceLayout(0, epi))                  # [BM]
    part_offsets = gl.expand_dims(local, 1) * BM + gl.expand_dims(rows, 0)  # a partial tile
    sum_squares = _handed_over_sum_squares(ss_ptr, rows, M, SS_PARTS, SS_PARTS_P2, epi, "")

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    stop = start + num                        # this program's steps: [start, stop)
    first_tile = start // k_steps
    last_tile = (stop - 1) // k_steps
    # a run that starts inside a tile and goes on past it holds that first segment's sums in
    # registers and finishes it after the run (so no arrival fence comes mid-run; it measured
    # the same as finishing at once, run 20)
    hold_first = (first_tile != last_tile) & (start % k_steps != 0)
    held = gl.zeros([BLOCK_N, BM], gl.float32, mma)
    held_up = gl.zeros([BLOCK_N, BM], gl.float32, mma)
    for tile in range(first_tile, last_tile + 1):   # the run's segment of each tile
        acc = gl.zeros([BLOCK_N, BM], gl.float32, mma)
        acc_up = gl.zeros([BLOCK_N, BM], gl.float32, mma)
        for step in range(gl.maximum(start, tile * k_steps),
                          gl.minimum(stop, (tile + 1) * k_steps)):
            i = step - start                  # the ring runs on across tiles
            acc, acc_up = _multiply_stage(acc, acc_up, w_smem, u_smem, x_smem, bars, i, STAGES,
                                          SUB, GATED)
            ahead = i - 1 + STAGES            # refill the previous step's stage
            ok = (i > 0) & (ahead < num)
            prev = (i + STAGES - 1) % STAGES
            n0, up_row, k = _step_coords(start + ahead, k_steps, N, BLOCK_N, BK)
            mbarrier.expect(bars.index(prev), stage_bytes, pred=ok)
            _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bars.index(prev), prev, n0,
                        up_row, k, ok, SUB, GATED, True, True)
        if GATED:
            acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        if (tile == first_tile) & hold_first:
            held = acc
            held_up = acc_up
        else:
            if TRIGGER_AFTER_LOOP:
                if tile == last_tile:
                    _gdc_launch_dependents(PDL)
            _finish_segment(gl.convert_layout(acc, epi), gl.convert_layout(acc_up, epi),
                            gl.minimum(stop, (tile + 1) * k_steps) - 1, start, pid,
                            per_program, k_steps, local, rows, part_offsets, sum_squares,
                            bias_ptr, residual_ptr, out_ptr, partial_ptr, counter_ptr, ss_ptr,
                            M, N, K, residual_stride, out_stride, eps, BLOCK_N, BM, HAS_BIAS,
                            NORM, GATED, HAS_RESIDUAL, EMIT_SS)
    if hold_first:
        _finish_segment(gl.convert_layout(held, epi), gl.convert_layout(held_up, epi),
                        (first_tile + 1) * k_steps - 1, start, pid, per_program, k_steps,
                        local, rows, part_offsets, sum_squares, bias_ptr, residual_ptr,
                        out_ptr, partial_ptr, counter_ptr, ss_ptr, M, N, K, residual_stride,
                        out_stride, eps, BLOCK_N, BM, HAS_BIAS, NORM, GATED, HAS_RESIDUAL,
                        EMIT_SS)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))


def _programs(device: torch.device) -> int:
    """Programs to split a GEMM's steps over: PROGRAMS, or one per SM."""
    return PROGRAMS or num_sms(device.index or 0)


def takes(out_features: int, block_n: int, split_k: int, emit_argmax: bool,
          device: torch.device) -> bool:
    """Whether stream-K runs this Gluon call: ENABLED, no row argmax, and a per-tile grid
    (out tiles x K splits programs) that is under four waves and not whole waves."""
    if not ENABLED or emit_argmax:
        return False
    tiles = triton.cdiv(out_features, block_n)
    sms = _programs(device)
    programs = tiles * split_k
    return tiles <= MAX_ARRIVAL_COUNTERS and programs < 4 * sms and programs % sms != 0


def launch(x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, counters, ss_ptr,
           ss_parts: int, *, block_m: int, block_n: int, norm_eps, gated: bool, residual,
           emit_ss: bool, pdl_options: dict) -> None:
    """Run the stream-K kernel with `linear_triton.linear`'s checked arguments (as
    `linear_gluon.launch`, without K splits or row maxima): its float32 partial tiles
    [programs, 2, 1 or 2 (gated), block_n, block_m] are allocated here."""
    num_rows, in_features = x.shape
    out_features = out.shape[1]
    sub = sub_boxes(block_n, gated)
    k_steps = triton.cdiv(in_features, BOX_K * sub)
    total_steps = triton.cdiv(out_features, block_n) * k_steps
    per_program = triton.cdiv(total_steps, _programs(x.device))
    programs = triton.cdiv(total_steps, per_program)
    partial = torch.empty(programs * 2 * (2 if gated else 1) * block_n * block_m,
                          dtype=torch.float32, device=x.device)
    w_desc, x_desc = descriptors(x, weight, block_m, block_n)
    ss_parts_p2 = triton.next_power_of_2(max(ss_parts, 1))
    _stream_k_kernel[(programs,)](
        w_desc, x_desc, bias if bias is not None else weight, out, out, partial, counters,
        ss_ptr, num_rows, out_features, in_features, k_steps, per_program, total_steps,
        out.stride(0), out.stride(0), 0.0 if norm_eps is None else norm_eps,
        HAS_BIAS=bias is not None, NORM=norm_eps is not None, GATED=gated,
        HAS_RESIDUAL=residual is not None, EMIT_SS=emit_ss, SS_PARTS=ss_parts,
        SS_PARTS_P2=ss_parts_p2, STAGES=stages_for(block_m, block_n, gated), SUB=sub,
        PDL=bool(pdl_options), TRIGGER_AFTER_LOOP=pdl.release_after_loop("linear_gluon"),
        num_warps=4, **pdl_options)
