"""Skinny GEMM in Gluon for decode on Hopper: the weight streamed by TMA, its first tiles
requested before the PDL wait.

`kernels/linear_triton.py`'s kernel computes the same tiles, but Triton's software pipeliner
issues the x and weight loads of its first stages together, after `griddepcontrol.wait`; so a
GEMM's first weight bytes are requested only once the previous kernel has completed. Weights
are written by no kernel, so they may be read before the wait (`kernels/pdl.py`). Gluon
(Triton's tile-level dialect, `triton.experimental.gluon`) lets a kernel say when each copy is
issued: here each program requests its first STAGES weight tiles, then waits, then requests x's.
So the next GEMM's weight bytes stream while the previous kernel drains.

Where it runs: `linear_triton.linear` hands it the calls of the row buckets in
`KernelConfig.gluon_block_m` (the 64-row bucket: batches of 33-64 sequences) with that
bucket's tuned BLOCK_N and SPLIT_K, on a Hopper GPU with TMA-aligned operands; a norm GEMM
without handed-over sums of squares (the first layer's qkv) stays on the Triton kernel, which
computes them. H200, Llama-3-8B decode at batch 64, same process (benchmarks/RESULTS.md run 18):
+2.5-3.6% tokens/s over the Triton kernel (13,259.7 / 13,202.4 against 12,923.7 / 12,875.9 on
one machine); with the weights requested after the wait instead, the Gluon kernel is no faster
than Triton's (12,885.0). At 1-32 rows it was 3-5% slower (b=1 238.9 against 250.3), so those
buckets keep the Triton kernel.

Design (one [BLOCK_N, BLOCK_M] output tile of `y^T = W x^T` per program, K split SPLIT_K ways;
BLOCK_M = the row bucket, 16 to 64):
- a ring of STAGES shared-memory stages (as many as STAGE_BUDGET holds, 2-8), each SUB_BOXES
  (one for weight tiles of more than 128 rows, `sub_boxes`) boxes of 64 K columns (128
  bytes, the widest 128-byte-swizzled TMA box) of a weight tile [BLOCK_N, 64] (two with
  GATED: gate and up rows) and of an x tile [BLOCK_M, 64], filled by
  TMA copies that complete on the stage's mbarrier; rows of x past M are zero-filled by the
  copy. Run 18 measured one box per stage without the deferred wait below, and 96 / 128 / 160
  / 224 KiB of stages: 192 KiB and two boxes were fastest (within ~1% of 128 and 160 KiB);
- per box one asynchronous Hopper wgmma: the weight tile is the A operand and x^T (a
  transposed view of the x tile) the B operand, both read from shared memory; once a step's
  wgmmas have completed (checked one step later, so they overlap the next wait) their stage
  is refilled with the tile STAGES steps ahead;
- the epilogue is `linear_triton._epilogue`'s (norm scale from handed-over sums of squares,
  bias, SiLU gate, residual add, sums of squares out), and split K finishes as there: the last
  split to arrive on the tile's arrival counter sums the float32 partials in split order.

The launch needs BLOCK_N a multiple of 64 (a Hopper wgmma spans 64 rows over 4 warps).

PDL release: after the K loop for qkv and the LM head, right after the wait for gate_up, o and
down (`KernelConfig.pdl_release_early` names them by `epilogue_role`). Run 23 (batch 64, same process;
benchmarks/RESULTS.md): +0.9-1.5%, the next GEMM's programs taking the SMs that o and gate_up's
second wave leave idle; every Gluon GEMM released early lost (run 19: 13,017.5 against
13,120.7 / 13,055.8; run 23: -1.9%), from qkv's release (the attention's programs then wait on
the SMs qkv leaves idle). With 96 KiB of stages (two programs per SM) 12,221.3, and released
early so that the next GEMM's programs share the SMs 11,393.4: shared memory in flight per SM
is what the stream needs. An L2 prefetch of the next GEMM's first stages by this GEMM's last
programs after their K loop lost 2-3% (12,629.7-12,744.3 against 13,020.6 / 12,960.4), and a K
split of the 64-row qkv (norm from handed-over sums) lost 5-8%.

Run 21 (Llama-3-8B's four 64-row GEMMs in a PDL chain, a grid sweep since removed,
in git history): the then committed tiles (BLOCK_N 64; K split 2 for o and down) beat every one-wave
tiling (128- or 256-row tiles, which read x once for two or four wgmma row blocks: 5-247%
slower); x's tiles in a ring of their own (3 / 2 stages, the rest for the weight's) lost 20-29%
/ 64-111%; each program starting its K loop at another x tile lost 2.6% at batch 64 in the
engine. All programs reading the same x tile at about the same time, from one ring, is what
this design keeps. Run 22: o unsplit (64 programs; run 21's sweep had not tried it) took 12.4
against 13.9 us split twice, and decode at batch 64 gained 0.45-0.84% in one process, so the
H200 config runs o unsplit; down unsplit was slower (35.3 against 34.9 us) and stays split.

Numerics: as `linear_triton` (float32 accumulation of bf16 products, one rounding); results
agree with the Triton kernel to bf16 rounding (tests/kernels/test_linear_gluon.py).
Gluon is experimental in Triton: the code targets 3.6's API (the device's) and two names that
later versions renamed; `linear_triton` falls back to its own kernel where the import fails.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from deepinfer.kernels import pdl
from deepinfer.kernels.settings import DEFAULT, KernelConfig

BOX_K = 64              # K columns per TMA box: 128 bytes of bf16, one 128-byte-swizzled row
SUB_BOXES = 2           # boxes per pipeline stage: K columns per stage = SUB_BOXES * BOX_K
STAGE_BUDGET = 192 * 1024   # shared memory for the stages (run 18: 96-224 KiB measured)

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# Names that later Triton versions changed (the device runs 3.6; this machine's may be newer,
# for the offline sm_90 compile checks): a TMA copy from global to shared memory,
# `async_copy_global_to_shared` in 3.6, then `async_load`
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a barrier of the program's threads: `thread_barrier` in Triton 3.6, `barrier` later
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _gdc_wait(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bar, stage, n0, up_row, k, ok,
                SUB: gl.constexpr, GATED: gl.constexpr, WEIGHTS: gl.constexpr,
                X: gl.constexpr):
    """Request stage `stage`'s SUB boxes of 64 K columns from column k: the weight's (and the
    up rows' if GATED) if WEIGHTS, x's if X; all complete on `bar`. Skipped unless `ok`."""
    BOX: gl.constexpr = w_desc.block_type.shape[1]
    for j in gl.static_range(SUB):
        if WEIGHTS:
            _tma_load(w_desc, [n0, k + j * BOX], bar, w_smem.index(stage * SUB + j), pred=ok)
            if GATED:
                _tma_load(w_desc, [up_row, k + j * BOX], bar, u_smem.index(stage * SUB + j),
                          pred=ok)
        if X:
            _tma_load(x_desc, [0, k + j * BOX], bar, x_smem.index(stage * SUB + j), pred=ok)


@gluon.jit
def _stage_ring(w_desc, x_desc, STAGES: gl.constexpr, SUB: gl.constexpr, GATED: gl.constexpr):
    """Shared memory for STAGES pipeline stages of SUB boxes each: weight tiles (and up rows'
    if GATED; else the weight's buffer stands in), x tiles, and one initialised mbarrier per
    stage. Returns (w_smem, u_smem, x_smem, bars)."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BOX: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = w_desc.dtype
    w_smem = gl.allocate_shared_memory(dtype, [STAGES * SUB, BLOCK_N, BOX], w_desc.layout)
    if GATED:
        u_smem = gl.allocate_shared_memory(dtype, [STAGES * SUB, BLOCK_N, BOX], w_desc.layout)
    else:
        u_smem = w_smem
    x_smem = gl.allocate_shared_memory(dtype, [STAGES * SUB, BM, BOX], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    return w_smem, u_smem, x_smem, bars


@gluon.jit
def _handed_over_sum_squares(ss_ptr, rows, M, SS_PARTS: gl.constexpr,
                             SS_PARTS_P2: gl.constexpr, layout: gl.constexpr,
                             CACHE: gl.constexpr):
    """[BM] float32 sums of squares of x's rows from SS_PARTS handed-over partials ([SS_PARTS,
    M] at ss_ptr, summed in order); zeros when SS_PARTS is 0 (no norm from partials). CACHE:
    the loads' cache modifier (".cg": from L2, for partials written by other programs of the
    same kernel)."""
    sum_squares = gl.zeros(rows.shape, gl.float32, gl.SliceLayout(0, layout))
    if SS_PARTS > 0:
        part = gl.arange(0, SS_PARTS_P2, layout=gl.SliceLayout(1, layout))
        ss_parts = gl.load(ss_ptr + gl.expand_dims(part, 1) * M + gl.expand_dims(rows, 0),
                           mask=gl.expand_dims(part < SS_PARTS, 1) & gl.expand_dims(rows < M, 0),
                           other=0.0, cache_modifier=CACHE)
        sum_squares = gl.sum(ss_parts, axis=0)
    return sum_squares


@gluon.jit
def _multiply_stage(acc, acc_up, w_smem, u_smem, x_smem, bars, i, STAGES: gl.constexpr,
                    SUB: gl.constexpr, GATED: gl.constexpr):
    """Step i of the K loop: wait for its stage's copies, then one asynchronous wgmma per box
    (weight tile A, x^T B) into acc (and acc_up if GATED); returns with this step's MMAs
    still running and every earlier step's done (so its stage may be refilled)."""
    s = i % STAGES
    mbarrier.wait(bars.index(s), (i // STAGES) & 1)
    for j in gl.static_range(SUB):
        x_t = x_smem.index(s * SUB + j).permute((1, 0))                     # [BOX, BM]
        acc = warpgroup_mma(w_smem.index(s * SUB + j), x_t, acc, is_async=True)
        if GATED:
            acc_up = warpgroup_mma(u_smem.index(s * SUB + j), x_t, acc_up, is_async=True)
    if GATED:
        acc, acc_up = warpgroup_mma_wait(2 * SUB, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(SUB, deps=(acc,))
    return acc, acc_up


@gluon.jit
def _epilogue(acc, acc_up, sum_squares, residual, rows, cols, tile_ok, N, K, eps, bias_ptr,
              out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, M, pid_n,
              HAS_BIAS: gl.constexpr, NORM: gl.constexpr, GATED: gl.constexpr,
              HAS_RESIDUAL: gl.constexpr, EMIT_SS: gl.constexpr, EMIT_ARGMAX: gl.constexpr):
    """`linear_triton._epilogue` on a transposed [BLOCK_N, BLOCK_M] tile (cols x rows)."""
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    if NORM:
        inv_rms = gl.expand_dims(gl.rsqrt(sum_squares / K + eps), 0)       # [1, BM]
        acc = acc * inv_rms
        if GATED:
            acc_up = acc_up * inv_rms
    if HAS_BIAS:
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
        acc += gl.expand_dims(bias, 1)
    if GATED:
        gate = acc.to(dtype).to(gl.float32)
        silu = (gate / (1.0 + gl.exp(-gate))).to(dtype)
        result = silu * acc_up.to(dtype)
    elif HAS_RESIDUAL:
        result = acc.to(dtype).to(gl.float32) + residual.to(gl.float32)
    else:
        result = acc
    offsets = gl.expand_dims(rows.to(gl.int64), 0) * out_stride + gl.expand_dims(cols, 1)
    gl.store(out_ptr + offsets, result.to(dtype), mask=tile_ok)
    if EMIT_SS:
        stored = gl.where(tile_ok, result.to(dtype).to(gl.float32), 0.0)
        gl.store(ss_ptr + pid_n * M + rows, gl.sum(stored * stored, axis=0), mask=rows < M)
    if EMIT_ARGMAX:   # linear_triton._store_row_argmax on the transposed tile (axis 0)
        key = gl.where(tile_ok, result.to(dtype).to(gl.float32), float("-inf"))
        key = gl.where(key != key, float("inf"), key)
        best = gl.max(key, axis=0)
        first = gl.min(gl.where(key == gl.expand_dims(best, 0), gl.expand_dims(cols, 1),
                                2147483647), axis=0)
        gl.store(max_ptr + pid_n * M + rows, best, mask=rows < M)
        gl.store(argmax_ptr + pid_n * M + rows, first, mask=rows < M)


@gluon.jit
def _skinny_kernel(w_desc, x_desc, bias_ptr, residual_ptr, out_ptr, partial_ptr, counter_ptr,
                   ss_ptr, max_ptr, argmax_ptr, M, N, K, k_tiles_per_split, residual_stride,
                   out_stride, eps,
                   HAS_BIAS: gl.constexpr, NORM: gl.constexpr, GATED: gl.constexpr,
                   HAS_RESIDUAL: gl.constexpr, EMIT_SS: gl.constexpr,
                   EMIT_ARGMAX: gl.constexpr, SS_PARTS: gl.constexpr,
                   SS_PARTS_P2: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
                   SUB: gl.constexpr,
                   PDL: gl.constexpr,
                   TRIGGER_AFTER_LOOP: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BOX: gl.constexpr = w_desc.block_type.shape[1]   # K columns per TMA box (128 bytes)
    BK: gl.constexpr = BOX * SUB                      # K columns per stage
    BM: gl.constexpr = x_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    up_row = N + n0                         # GATED: the up rows follow the N gate rows
    first = pid_k * k_tiles_per_split       # this split's first K tile; trailing splits may
    num_k = gl.minimum(k_tiles_per_split, gl.cdiv(K, BK) - first)   # have none (num_k <= 0)

    w_smem, u_smem, x_smem, bars = _stage_ring(w_desc, x_desc, STAGES, SUB, GATED)
    w_bytes: gl.constexpr = w_desc.block_type.nbytes * (2 if GATED else 1)
    stage_bytes: gl.constexpr = SUB * (w_bytes + x_desc.block_type.nbytes)

    for st in gl.static_range(STAGES):      # the weights: written by no kernel
        mbarrier.expect(bars.index(st), stage_bytes, pred=st < num_k)
        _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bars.index(st), st, n0, up_row,
                    (first + st) * BK, st < num_k, SUB, GATED, True, False)
    _gdc_wait(PDL)                          # x, the residual, partials: the previous kernel's
    if not TRIGGER_AFTER_LOOP:
        _gdc_launch_dependents(PDL)
    for st in gl.static_range(STAGES):
        _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bars.index(st), st, n0, up_row,
                    (first + st) * BK, st < num_k, SUB, GATED, False, True)

    epi: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, epi))        # [BN]
    rows = gl.arange(0, BM, layout=gl.SliceLayout(0, epi))                  # [BM]
    tile_ok = gl.expand_dims(cols < N, 1) & gl.expand_dims(rows < M, 0)
    residual = gl.zeros([BLOCK_N, BM], gl.float32, epi)
    if HAS_RESIDUAL:    # loaded now, so its latency is not added after the K loop
        residual = gl.load(residual_ptr + gl.expand_dims(rows.to(gl.int64), 0) * residual_stride
                           + gl.expand_dims(cols, 1), mask=tile_ok, other=0.0).to(gl.float32)
    sum_squares = _handed_over_sum_squares(ss_ptr, rows, M, SS_PARTS, SS_PARTS_P2, epi, "")

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    acc = gl.zeros([BLOCK_N, BM], gl.float32, mma)
    acc_up = gl.zeros([BLOCK_N, BM], gl.float32, mma)
    for i in range(num_k):
        acc, acc_up = _multiply_stage(acc, acc_up, w_smem, u_smem, x_smem, bars, i, STAGES,
                                      SUB, GATED)
        # the previous step's MMAs are done: refill its stage with the tile STAGES after it
        ahead = i - 1 + STAGES
        ok = (i > 0) & (ahead < num_k)
        prev = (i + STAGES - 1) % STAGES
        mbarrier.expect(bars.index(prev), stage_bytes, pred=ok)
        _load_stage(w_desc, x_desc, w_smem, u_smem, x_smem, bars.index(prev), prev, n0, up_row,
                    (first + ahead) * BK, ok, SUB, GATED, True, True)
    if GATED:
        acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    if TRIGGER_AFTER_LOOP:
        _gdc_launch_dependents(PDL)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))

    _finish_tile(gl.convert_layout(acc, epi), gl.convert_layout(acc_up, epi), sum_squares,
                 residual, rows, cols, tile_ok, N, K, eps, bias_ptr, out_ptr, out_stride, ss_ptr,
                 max_ptr, argmax_ptr, partial_ptr, counter_ptr, M, pid_n, pid_k, HAS_BIAS, NORM,
                 GATED, HAS_RESIDUAL, EMIT_SS, EMIT_ARGMAX, SPLIT_K)


@gluon.jit
def _finish_tile(acc, acc_up, sum_squares, residual, rows, cols, tile_ok, N, K, eps, bias_ptr,
                 out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, partial_ptr, counter_ptr, M,
                 pid_n, pid_k, HAS_BIAS: gl.constexpr, NORM: gl.constexpr,
                 GATED: gl.constexpr, HAS_RESIDUAL: gl.constexpr, EMIT_SS: gl.constexpr,
                 EMIT_ARGMAX: gl.constexpr, SPLIT_K: gl.constexpr):
    """Output tile pid_n's epilogue from K split pid_k's accumulators (in the epilogue layout):
    with one split, `_epilogue` on them; else the split's float32 partial is stored and the
    split that arrives last on the tile's counter (counter_ptr + pid_n) sums all partials in
    split order, runs `_epilogue` and resets the counter. Returns whether this program wrote
    the tile's output (a scalar)."""
    if SPLIT_K > 1:   # (NORM and GATED need one split: the launchers check)
        tile_offsets = gl.expand_dims(rows.to(gl.int64), 0) * N + gl.expand_dims(cols, 1)
        gl.store(partial_ptr + pid_k * M * N + tile_offsets, acc, mask=tile_ok)
        _thread_barrier()   # every thread's partial is written before the arrival counts
        counter = counter_ptr + pid_n
        arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        wrote = arrived == SPLIT_K - 1
        if wrote:   # the last split of this tile: sum all, in split order
            _thread_barrier()
            total = gl.zeros_like(acc)
            for split in gl.static_range(SPLIT_K):
                total += gl.load(partial_ptr + split * M * N + tile_offsets, mask=tile_ok,
                                 other=0.0, cache_modifier=".cg")
            _epilogue(total, acc_up, sum_squares, residual, rows, cols, tile_ok, N, K, eps,
                      bias_ptr, out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, M, pid_n,
                      HAS_BIAS, NORM, GATED, HAS_RESIDUAL, EMIT_SS, EMIT_ARGMAX)
            gl.atomic_xchg(counter, 0)
    else:
        wrote = pid_n >= 0
        _epilogue(acc, acc_up, sum_squares, residual, rows, cols, tile_ok, N, K, eps,
                  bias_ptr, out_ptr, out_stride, ss_ptr, max_ptr, argmax_ptr, M, pid_n,
                  HAS_BIAS, NORM, GATED, HAS_RESIDUAL, EMIT_SS, EMIT_ARGMAX)
    return wrote


def sub_boxes(block_n: int, gated: bool) -> int:
    """Boxes per stage: SUB_BOXES, or one where a box of weight rows (gate and up rows if
    gated) is wider than 128 rows (so a stage's weight stays within 32 KiB)."""
    return SUB_BOXES if block_n * (2 if gated else 1) <= 128 else 1


def stages_for(block_m: int, block_n: int, gated: bool) -> int:
    """Pipeline stages that fit STAGE_BUDGET bytes of shared memory (2 to 8)."""
    stage_bytes = (block_n * (2 if gated else 1) + block_m) * BOX_K * sub_boxes(block_n, gated) * 2
    return max(2, min(8, STAGE_BUDGET // stage_bytes))


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `launch` takes x and weight (on a Hopper GPU): bf16 / fp16, 16-byte aligned
    rows (TMA's requirement)."""
    return (x.dtype in _GL_DTYPES and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and (x.stride(0) * x.element_size()) % 16 == 0
            and (weight.stride(0) * weight.element_size()) % 16 == 0)


def descriptors(x: torch.Tensor, weight: torch.Tensor, block_m: int,
                block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the weight ([block_n, BOX_K] boxes) and x ([block_m, BOX_K] boxes),
    128-byte swizzled for wgmma."""
    dtype = _GL_DTYPES[x.dtype]
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, BOX_K], dtype)
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, BOX_K], dtype)
    return (TensorDescriptor(weight, list(weight.shape), list(weight.stride()),
                             [block_n, BOX_K], w_layout),
            TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, BOX_K], x_layout))


def launch(x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, partial, counters,
           ss_ptr, ss_parts: int, *, block_m: int, block_n: int, split_k: int, norm_eps,
           gated: bool, residual, emit_ss: bool, maxima, columns, emit_argmax: bool,
           pdl_options: dict, settings: KernelConfig = DEFAULT) -> None:
    """Run the Gluon kernel with `linear_triton.linear`'s checked arguments: out (the residual
    when adding in place), the split-K partials [split_k, M, N] and arrival counters, the
    sums-of-squares tensor and its part count, the row maxima buffers. K is cut into tiles of
    SUB_BOXES * BOX_K columns, split_k runs of them; trailing splits may get none (they add
    zeros, as in `linear_triton`)."""
    num_rows, in_features = x.shape
    out_features = out.shape[1]
    per_split = triton.cdiv(triton.cdiv(in_features, BOX_K * sub_boxes(block_n, gated)),
                            split_k)
    w_desc, x_desc = descriptors(x, weight, block_m, block_n)
    ss_parts_p2 = triton.next_power_of_2(max(ss_parts, 1))
    _skinny_kernel[(triton.cdiv(out_features, block_n), split_k)](
        w_desc, x_desc, bias if bias is not None else weight, out, out, partial, counters,
        ss_ptr, maxima, columns, num_rows, out_features, in_features, per_split, out.stride(0),
        out.stride(0), 0.0 if norm_eps is None else norm_eps, HAS_BIAS=bias is not None,
        NORM=norm_eps is not None, GATED=gated, HAS_RESIDUAL=residual is not None,
        EMIT_SS=emit_ss, EMIT_ARGMAX=emit_argmax, SS_PARTS=ss_parts, SS_PARTS_P2=ss_parts_p2,
        SPLIT_K=split_k, STAGES=stages_for(block_m, block_n, gated),
        SUB=sub_boxes(block_n, gated),
        PDL=bool(pdl_options),
        TRIGGER_AFTER_LOOP=pdl.release_after_loop("linear_gluon", epilogue_role(
            gated, residual is not None, norm_eps is not None), settings),
        num_warps=4, **pdl_options)


def epilogue_role(gated: bool, residual: bool, norm: bool) -> str:
    """A GEMM's role for `pdl.release_after_loop`, named by its epilogue: "gated" (SiLU gate:
    an MLP's gate_up, whose output feeds the down GEMM), "residual" (o, down: added into the
    residual stream, which feeds the next norm GEMM), "norm" (normed input: qkv, read next by
    the attention), "plain"."""
    return "gated" if gated else "residual" if residual else "norm" if norm else "plain"
