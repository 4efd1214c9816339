"""A decoder layer's 64-row decode GEMMs after its attention, o -> gate_up -> down -> the next
layer's qkv, in one persistent Gluon kernel on Hopper (an experiment: not used by the engine).

At batch 64 each of `kernels/linear_gluon.py`'s GEMMs loses ~4-6 us at its boundaries
(benchmarks/RESULTS.md runs 19-21): its last programs drain while the others idle, it exits,
and only then do the next GEMM's programs get the SMs and request their weights. Here one
program per SM runs all four GEMMs' tiles in order. Once a program has finished a tile (or,
with VARIANT's PREFETCH_FIRST, right after its K loop) it requests the first weight tiles of
its next tile, the next GEMM's included (weights are written by no kernel), and only then
waits for the GEMM its next tile depends on. So a program's stage ring refills while the
slowest tile of the previous GEMM finishes, with no kernel exit and launch in between.

Dependencies between GEMMs are counters in global memory (`kernels.backends.arrival_counters`,
the last DONE_SLOTS): the program that writes an output tile (for a split-K tile, the split
that finishes it) counts it done with a release; a program about to read a GEMM's output (its
x, the residual stream, the sums of squares) waits with acquire loads until that GEMM's count
is complete, then fences the async proxy so that its TMA copies of x see the data. The last
program to exit resets the counters. The whole grid is resident (one program per SM, at most
the SM count) and a program only waits on GEMMs earlier in the order, which every program
runs before any later one: no deadlock. PDL: the first weight tiles are requested before
`griddepcontrol.wait`; dependents are released after the last GEMM's K loop.

Each GEMM is the per-GEMM Gluon kernel's (`linear_gluon._skinny_kernel`) with BLOCK_N 64: same
tiles, same order of wgmma accumulation, same split-K finish and epilogue, so the outputs are
bitwise those of the four `linear_gluon` launches (tests/kernels/test_linear_gluon_layer.py).
One ring of STAGES stages of 32 KiB serves every GEMM: a stage holds two [64, 64] weight boxes
and two x boxes; a plain GEMM fills them with two K boxes (128 columns), the gated gate_up with
its gate and up rows of one K box (64 columns, one x box).

Measured (H200, Llama-3-8B shapes, 64 rows, 8 layers in a CUDA graph; benchmarks/
gluon_layer_bench.py, benchmarks/RESULTS.md run 22): **slower than the four kernels**, 136.8-
143.8 us per layer against 126.0-128.1, so the engine does not use it. Its timeline
(`launch(trace=...)`) shows where: the split-K finishes of o and down take 4-6 us from the last
K loop to the last done count (a chain of dependent memory operations, queued behind the weight
stream), gate_up's 224 tiles on 132 programs take ~4 us longer than the separate kernel's two
waves (its 64-column steps and fixed tile-to-program assignment: more weight in flight did
not help the separate kernel either, run 22 call 7), and the boundary between two layer kernels
still costs ~4 us. The next steps it points to: a split-K finish off the critical path, and
gate_up's second-wave tiles handed out dynamically.

Roles (as `kernels.fused_linear` runs them at 64 rows): o adds into the residual stream in
place and writes its rows' sums of squares per output tile (K split O_SPLIT ways); gate_up
normalises from them and applies SiLU(gate) * up; down adds into the stream and writes the sums
of squares again (DOWN_SPLIT ways); the next layer's qkv normalises from those (absent after the
last layer: the caller's final norm reads the sums instead).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from deepinfer.kernels.backends import MAX_ARRIVAL_COUNTERS, arrival_counters, num_sms
from deepinfer.kernels.linear_gluon import (BOX_K, _finish_tile, _gdc_launch_dependents, _gdc_wait,
                                  _handed_over_sum_squares, _thread_barrier, _tma_load,
                                  descriptors)

BLOCK_N = 64            # output features per tile (one wgmma row block)
STAGES = 6              # pipeline stages of 32 KiB: 192 KiB, one program per SM
DONE_SLOTS = 5          # counters: o, gate_up, down and qkv tiles done; programs exited
# the kernels' constexpr copies of the above
_BN = gl.constexpr(BLOCK_N)
_BOX = gl.constexpr(BOX_K)
_SLOTS = gl.constexpr(DONE_SLOTS)
_DONE_AT = gl.constexpr(MAX_ARRIVAL_COUNTERS - DONE_SLOTS)
# Where the next item's weights are requested (benchmarks/gluon_layer_bench.py --variants):
# PREFETCH_FIRST, before the finished tile's epilogue (else after its done count); EARLY, how
# many of its stages' weights before the wait for the GEMM it depends on (the rest with x's
# copies after it). Run 22: 6 stages before the epilogue 140.7-143.8 us per layer, 6 after it
# 137.9-140.2, 2 after it 137.1 (benchmarks/RESULTS.md).
VARIANT = dict(PREFETCH_FIRST=False, EARLY=2)


@gluon.jit
def _fence_proxy_async():
    """Order this thread's earlier generic-proxy accesses before its later async-proxy (TMA)
    ones, on global memory (PTX `fence.proxy.async.global`)."""
    gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _load_acquire(ptr):
    """This thread's acquire load (gpu scope) of the int32 at ptr."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stamp(trace_ptr, pid, slot, TRACE: gl.constexpr):
    """With TRACE, store the global timer (ns) at trace_ptr[pid, slot] ([programs, 16] int64)."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                        is_pure=False, pack=1)
        gl.store(trace_ptr + pid * 16 + slot, now)


@gluon.jit
def _wait_count(ptr, target):
    """Spin until the counter at ptr reaches target (each thread's own acquire loads), then
    order the TMA copies that follow after them (they read data the count guards)."""
    count = _load_acquire(ptr)
    while count < target:
        count = _load_acquire(ptr)
    _fence_proxy_async()


@gluon.jit
def _request(w_desc, x_desc, w_smem, x_smem, bars, pos, n0, up_row, k, ok,
             STAGES: gl.constexpr, GATED: gl.constexpr, WEIGHTS: gl.constexpr,
             X: gl.constexpr):
    """TMA copies of ring position pos (stage pos % STAGES) from K column k, completing on the
    stage's barrier: the weight boxes if WEIGHTS (two K boxes of rows n0..; gated: the gate
    rows n0.. and up rows up_row.. of one K box), the x boxes if X. Skipped unless ok."""
    BOX: gl.constexpr = w_desc.block_type.shape[1]
    s = pos % STAGES
    bar = bars.index(s)
    if WEIGHTS:
        _tma_load(w_desc, [n0, k], bar, w_smem.index(2 * s), pred=ok)
        if GATED:
            _tma_load(w_desc, [up_row, k], bar, w_smem.index(2 * s + 1), pred=ok)
        else:
            _tma_load(w_desc, [n0, k + BOX], bar, w_smem.index(2 * s + 1), pred=ok)
    if X:
        _tma_load(x_desc, [0, k], bar, x_smem.index(2 * s), pred=ok)
        if not GATED:
            _tma_load(x_desc, [0, k + BOX], bar, x_smem.index(2 * s + 1), pred=ok)


@gluon.jit
def _tile(t, N, K, k_per_split, SPLIT_K: gl.constexpr, GATED: gl.constexpr):
    """Item t of a GEMM (output tile t % tiles, K split t // tiles): (pid_n, pid_k, n0,
    up_row, first K column, K steps; trailing splits may have none)."""
    BK: gl.constexpr = _BOX if GATED else 2 * _BOX
    tiles = gl.cdiv(N, _BN)
    pid_n = t % tiles
    pid_k = t // tiles
    first = pid_k * k_per_split
    num_k = gl.minimum(k_per_split, gl.cdiv(K, BK) - first)
    return pid_n, pid_k, pid_n * _BN, N + pid_n * _BN, first * BK, num_k


@gluon.jit
def _prefetch(w_desc, x_desc, w_smem, x_smem, bars, pos, t, N, K, k_per_split,
              STAGES: gl.constexpr, SPLIT_K: gl.constexpr, GATED: gl.constexpr,
              EARLY: gl.constexpr):
    """Request item t's first EARLY weight steps into ring positions pos..; its x copies and
    the other stages' weights follow in `_mainloop` (each stage's barrier expects both)."""
    BK: gl.constexpr = _BOX if GATED else 2 * _BOX
    _, _, n0, up_row, k0, num_k = _tile(t, N, K, k_per_split, SPLIT_K, GATED)
    nbytes: gl.constexpr = (2 * w_desc.block_type.nbytes
                            + (1 if GATED else 2) * x_desc.block_type.nbytes)
    for j in gl.static_range(STAGES):
        ok = j < num_k
        mbarrier.expect(bars.index((pos + j) % STAGES), nbytes, pred=ok)
        if j < EARLY:
            _request(w_desc, x_desc, w_smem, x_smem, bars, pos + j, n0, up_row, k0 + j * BK,
                     ok, STAGES, GATED, True, False)


@gluon.jit
def _mainloop(w_desc, x_desc, w_smem, x_smem, bars, pos, n0, up_row, k0, num_k,
              STAGES: gl.constexpr, GATED: gl.constexpr, EARLY: gl.constexpr,
              num_warps: gl.constexpr):
    """The K loop of a tile whose weight steps `_prefetch` requested at ring position pos:
    x's copies, then per step one wgmma per box (weight A, x^T B), the stage refilled once its
    wgmmas are done. Returns the [_BN, BM] float32 accumulators (gate, up if GATED)."""
    BK: gl.constexpr = _BOX if GATED else 2 * _BOX
    BM: gl.constexpr = x_desc.block_type.shape[0]
    nbytes: gl.constexpr = (2 * w_desc.block_type.nbytes
                            + (1 if GATED else 2) * x_desc.block_type.nbytes)
    for j in gl.static_range(STAGES):
        _request(w_desc, x_desc, w_smem, x_smem, bars, pos + j, n0, up_row, k0 + j * BK,
                 j < num_k, STAGES, GATED, j >= EARLY, True)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    acc = gl.zeros([_BN, BM], gl.float32, mma)
    acc_up = gl.zeros([_BN, BM], gl.float32, mma)
    for i in range(num_k):
        g = pos + i
        s = g % STAGES
        mbarrier.wait(bars.index(s), (g // STAGES) & 1)
        x_t = x_smem.index(2 * s).permute((1, 0))                           # [BOX, BM]
        acc = warpgroup_mma(w_smem.index(2 * s), x_t, acc, is_async=True)
        if GATED:
            acc_up = warpgroup_mma(w_smem.index(2 * s + 1), x_t, acc_up, is_async=True)
            acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma(w_smem.index(2 * s + 1), x_smem.index(2 * s + 1).permute((1, 0)),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(2, deps=(acc,))
        # the previous step's wgmmas are done: refill its stage with the step STAGES after it
        ahead = i - 1 + STAGES
        ok = (i > 0) & (ahead < num_k)
        mbarrier.expect(bars.index((g + STAGES - 1) % STAGES), nbytes, pred=ok)
        _request(w_desc, x_desc, w_smem, x_smem, bars, g + STAGES - 1, n0, up_row,
                 k0 + ahead * BK, ok, STAGES, GATED, True, True)
    if GATED:
        acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    return acc, acc_up


@gluon.jit
def _prefetch_next(pos, pid, t, items, next_items, one, w_desc, x_desc, N, K, k_per_split,
                   next_w, next_x, next_N, next_K, next_k_per_split, w_smem, x_smem, bars,
                   STAGES: gl.constexpr, SPLIT_K: gl.constexpr, GATED: gl.constexpr,
                   NEXT: gl.constexpr, NEXT_SPLIT_K: gl.constexpr, NEXT_GATED: gl.constexpr,
                   EARLY: gl.constexpr):
    """Request the weights of this program's next item at ring position pos: item t of this
    GEMM if t < items, else (NEXT) the next GEMM's item pid if it has one. Returns 1 if
    something was requested, else 0 (int32)."""
    prefetched = one - 1
    if t < items:
        _prefetch(w_desc, x_desc, w_smem, x_smem, bars, pos, t, N, K, k_per_split, STAGES,
                  SPLIT_K, GATED, EARLY)
        prefetched = one
    else:
        if NEXT:
            if pid < next_items:
                _prefetch(next_w, next_x, w_smem, x_smem, bars, pos, pid, next_N, next_K,
                          next_k_per_split, STAGES, NEXT_SPLIT_K, NEXT_GATED, EARLY)
                prefetched = one
    return prefetched


@gluon.jit
def _gemm(pos, prefetched, pid, programs, w_desc, x_desc, N, K, k_per_split, out_ptr, ss_in_ptr,
          ss_out_ptr, eps, partial_ptr, counter_ptr, wait_ptr, wait_target, done_ptr,
          next_w, next_x, next_N, next_K, next_k_per_split, w_smem, x_smem, bars, M,
          NORM: gl.constexpr, GATED: gl.constexpr, RESIDUAL: gl.constexpr,
          SS_PARTS: gl.constexpr, SS_P2: gl.constexpr, SPLIT_K: gl.constexpr,
          WAIT: gl.constexpr, NEXT: gl.constexpr, NEXT_GATED: gl.constexpr,
          NEXT_SPLIT_K: gl.constexpr, LAST: gl.constexpr, PDL: gl.constexpr,
          STAGES: gl.constexpr, PREFETCH_FIRST: gl.constexpr, EARLY: gl.constexpr, trace_ptr,
          TRACE: gl.constexpr, PHASE: gl.constexpr, num_warps: gl.constexpr):
    """This program's items of one GEMM (t = pid, pid + programs, ...; `_tile`), after waiting
    (if WAIT) for wait_ptr's count to reach wait_target. Item pid's weights were requested
    already if `prefetched` (1). After each K loop the tile's epilogue runs and a finished tile
    counts itself done at done_ptr; the next item's weights (this GEMM's, or with NEXT the next
    GEMM's item pid) are requested before that epilogue with PREFETCH_FIRST, else after the
    count. Returns (ring position, next GEMM's item prefetched). `prefetched` is an int32 0 / 1
    (a runtime value, as it is loop-carried). PHASE: this GEMM's trace slots (`launch`)."""
    one = pid * 0 + 1
    BM: gl.constexpr = x_desc.block_type.shape[0]
    items = gl.cdiv(N, _BN) * SPLIT_K
    next_items = gl.cdiv(next_N, _BN) * NEXT_SPLIT_K
    if pid < items:
        if prefetched == 0:
            _prefetch(w_desc, x_desc, w_smem, x_smem, bars, pos, pid, N, K, k_per_split, STAGES,
                      SPLIT_K, GATED, EARLY)
        if WAIT:
            _wait_count(wait_ptr, wait_target)
        _stamp(trace_ptr, pid, 3 * PHASE + 1, TRACE)
        epi: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])
        rows = gl.arange(0, BM, layout=gl.SliceLayout(0, epi))                   # [BM]
        # sums of squares from the previous GEMM: read after the wait, from L2
        sum_squares = _handed_over_sum_squares(ss_in_ptr, rows, M, SS_PARTS, SS_P2, epi,
                                               ".cg")
        for t in range(pid, items, programs):
            pid_n, pid_k, n0, up_row, k0, num_k = _tile(t, N, K, k_per_split, SPLIT_K, GATED)
            cols = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(1, epi))      # [BN]
            tile_ok = gl.expand_dims(cols < N, 1) & gl.expand_dims(rows < M, 0)
            residual = gl.zeros([_BN, BM], gl.float32, epi)
            if RESIDUAL:
                residual = gl.load(out_ptr + gl.expand_dims(rows.to(gl.int64), 0) * N
                                   + gl.expand_dims(cols, 1), mask=tile_ok, other=0.0,
                                   cache_modifier=".cg").to(gl.float32)
            acc, acc_up = _mainloop(w_desc, x_desc, w_smem, x_smem, bars, pos, n0, up_row, k0,
                                    num_k, STAGES, GATED, EARLY, num_warps)
            pos += gl.maximum(num_k, 0)
            _stamp(trace_ptr, pid, 3 * PHASE + 2, TRACE)
            if LAST:
                if t + programs >= items:
                    _gdc_launch_dependents(PDL)
            if PREFETCH_FIRST:
                prefetched = _prefetch_next(pos, pid, t + programs, items, next_items, one,
                                            w_desc, x_desc, N, K, k_per_split, next_w, next_x,
                                            next_N, next_K, next_k_per_split, w_smem, x_smem,
                                            bars, STAGES, SPLIT_K, GATED, NEXT, NEXT_SPLIT_K,
                                            NEXT_GATED, EARLY)
            wrote = _finish_tile(gl.convert_layout(acc, epi), gl.convert_layout(acc_up, epi),
                                 sum_squares, residual, rows, cols, tile_ok, N, K, eps,
                                 out_ptr, out_ptr, N, ss_out_ptr, ss_out_ptr, ss_out_ptr,
                                 partial_ptr, counter_ptr, M, pid_n, pid_k, False, NORM, GATED,
                                 RESIDUAL, RESIDUAL, False, SPLIT_K)
            if wrote:
                _thread_barrier()           # every thread's stores precede the count
                gl.atomic_add(done_ptr, 1, sem="release", scope="gpu")
            _stamp(trace_ptr, pid, 3 * PHASE + 3, TRACE)
            if not PREFETCH_FIRST:
                prefetched = _prefetch_next(pos, pid, t + programs, items, next_items, one,
                                            w_desc, x_desc, N, K, k_per_split, next_w, next_x,
                                            next_N, next_K, next_k_per_split, w_smem, x_smem,
                                            bars, STAGES, SPLIT_K, GATED, NEXT, NEXT_SPLIT_K,
                                            NEXT_GATED, EARLY)
    else:
        prefetched = one - 1
    return pos, prefetched


@gluon.jit
def _layer_kernel(o_w, o_x, gu_w, gu_x, dn_w, dn_x, qkv_w, qkv_x, hidden_ptr, act_ptr, qkv_ptr,
                  partial_ptr, counter_ptr, ss_o_ptr, ss_dn_ptr, M, o_in, hidden_size,
                  intermediate, qkv_size, o_k_per_split, gu_k_per_split, dn_k_per_split,
                  qkv_k_per_split, eps_mlp, eps_qkv, SS_PARTS: gl.constexpr, SS_P2: gl.constexpr,
                  O_SPLIT: gl.constexpr, DN_SPLIT: gl.constexpr,
                  HAS_QKV: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                  PREFETCH_FIRST: gl.constexpr, EARLY: gl.constexpr, trace_ptr,
                  TRACE: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    dtype: gl.constexpr = o_w.dtype
    BOX: gl.constexpr = o_w.block_type.shape[1]
    BM: gl.constexpr = o_x.block_type.shape[0]
    w_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, _BN, BOX], o_w.layout)
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BM, BOX], o_x.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    done = counter_ptr + _DONE_AT
    o_tiles = gl.cdiv(hidden_size, _BN)
    gu_tiles = gl.cdiv(intermediate, _BN)

    prefetched = pid * 0
    if pid < o_tiles * O_SPLIT:   # o's weights: written by no kernel, requested before the wait
        _prefetch(o_w, o_x, w_smem, x_smem, bars, 0, pid, hidden_size, o_in, o_k_per_split,
                  STAGES, O_SPLIT, False, EARLY)
        prefetched += 1
    _gdc_wait(PDL)                  # the attention output, the stream, the counters
    _stamp(trace_ptr, pid, 0, TRACE)
    pos = pid * 0
    # flags after M: NORM, GATED, RESIDUAL, SS_PARTS, SS_P2, SPLIT_K, WAIT, NEXT, NEXT_GATED,
    # NEXT_SPLIT_K, LAST
    pos, prefetched = _gemm(
        pos, prefetched, pid, programs, o_w, o_x, hidden_size, o_in, o_k_per_split,
        hidden_ptr, ss_o_ptr, ss_o_ptr, 0.0, partial_ptr, counter_ptr, done, 0, done,
        gu_w, gu_x, intermediate, hidden_size, gu_k_per_split, w_smem, x_smem, bars, M,
        False, False, True, 0, 1, O_SPLIT, False, True, True, 1, False,
        PDL, STAGES, PREFETCH_FIRST, EARLY, trace_ptr, TRACE, 0, num_warps)
    pos, prefetched = _gemm(
        pos, prefetched, pid, programs, gu_w, gu_x, intermediate, hidden_size, gu_k_per_split,
        act_ptr, ss_o_ptr, ss_o_ptr, eps_mlp, partial_ptr, counter_ptr, done, o_tiles,
        done + 1, dn_w, dn_x, hidden_size, intermediate, dn_k_per_split, w_smem, x_smem, bars,
        M, True, True, False, SS_PARTS, SS_P2, 1, True, True, False, DN_SPLIT, False,
        PDL, STAGES, PREFETCH_FIRST, EARLY, trace_ptr, TRACE, 1, num_warps)
    pos, prefetched = _gemm(
        pos, prefetched, pid, programs, dn_w, dn_x, hidden_size, intermediate, dn_k_per_split,
        hidden_ptr, ss_dn_ptr, ss_dn_ptr, 0.0, partial_ptr, counter_ptr, done + 1, gu_tiles,
        done + 2, qkv_w, qkv_x, qkv_size, hidden_size, qkv_k_per_split, w_smem, x_smem, bars,
        M, False, False, True, 0, 1, DN_SPLIT, True, HAS_QKV, False, 1, not HAS_QKV,
        PDL, STAGES, PREFETCH_FIRST, EARLY, trace_ptr, TRACE, 2, num_warps)
    if HAS_QKV:
        pos, prefetched = _gemm(
            pos, prefetched, pid, programs, qkv_w, qkv_x, qkv_size, hidden_size,
            qkv_k_per_split, qkv_ptr, ss_dn_ptr, ss_dn_ptr, eps_qkv, partial_ptr, counter_ptr,
            done + 2, o_tiles, done + 3, qkv_w, qkv_x, qkv_size, hidden_size, qkv_k_per_split,
            w_smem, x_smem, bars, M, True, False, False, SS_PARTS, SS_P2, 1, True, False,
            False, 1, True, PDL, STAGES, PREFETCH_FIRST, EARLY, trace_ptr, TRACE, 3, num_warps)
    _gdc_launch_dependents(PDL)     # (programs without an item in the last GEMM)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
    _stamp(trace_ptr, pid, 13, TRACE)
    _thread_barrier()
    exited = gl.atomic_add(done + 4, 1, sem="acq_rel", scope="gpu")
    if exited == programs - 1:      # the last program out: reset for the next launch
        for slot in gl.static_range(_SLOTS):
            gl.atomic_xchg(done + slot, 0)


def launch(attn_out: torch.Tensor, hidden: torch.Tensor, o_weight: torch.Tensor,
           gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
           qkv_weight: torch.Tensor | None, eps_mlp: float, eps_qkv: float, *, o_split: int,
           down_split: int, pdl_options: dict, programs: int | None = None,
           trace: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """o, gate_up, down and the next layer's qkv of M <= 64 decode rows in one kernel.

    Args:
        attn_out: [M, q_size] the attention output (o's input), bf16 / fp16, contiguous.
        hidden: [M, H] the residual stream (nothing pending), contiguous: o's and down's
            outputs are added into it in place.
        o_weight: [H, q_size]; gate_up_weight: [2 I, H] (gate rows, then up rows; the
            post-attention norm's weight folded in); down_weight: [H, I]; qkv_weight: the
            next layer's [N_qkv, H] (input norm folded in) or None after the last layer.
        eps_mlp, eps_qkv: the two RMSNorms' epsilons.
        o_split, down_split: K splits of o and down (`kernels/configs`' tuned SPLIT_K).
        pdl_options: `pdl.launch_options` of the device ({} without PDL).
        programs: the grid (default: the SM count, or fewer where no GEMM has that many
            tiles); at most one program per SM fits (tests use fewer, so that programs run
            several tiles of a GEMM).
        trace: [programs, 16] int64 zeros, or None: each program stores the global timer
            (ns) at 0 after the PDL wait, 3 g + 1 after GEMM g's wait, 3 g + 2 / 3 g + 3 after
            its last tile's K loop / done count, 13 at its end (benchmarks' timelines).
    Returns:
        (qkv [M, N_qkv] or None, down's sums-of-squares partials [H / 64, M] float32 for the
        next norm: `kernels.fused_linear.AddedRows`).
    """
    rows, q_size = attn_out.shape
    hidden_size = hidden.shape[1]
    intermediate = down_weight.shape[1]
    device = attn_out.device
    qkv_size = qkv_weight.shape[0] if qkv_weight is not None else 0
    act = torch.empty(rows, intermediate, dtype=attn_out.dtype, device=device)
    qkv = (torch.empty(rows, qkv_size, dtype=attn_out.dtype, device=device)
           if qkv_weight is not None else None)
    parts = triton.cdiv(hidden_size, BLOCK_N)
    ss_o = torch.empty(parts, rows, dtype=torch.float32, device=device)
    ss_dn = torch.empty_like(ss_o)
    splits = max(o_split, down_split)
    partial = (torch.empty(splits, rows, hidden_size, dtype=torch.float32, device=device)
               if splits > 1 else ss_o)
    o_w, o_x = descriptors(attn_out, o_weight, 64, BLOCK_N)
    gu_w, gu_x = descriptors(hidden, gate_up_weight, 64, BLOCK_N)
    dn_w, dn_x = descriptors(act, down_weight, 64, BLOCK_N)
    qkv_w, qkv_x = (descriptors(hidden, qkv_weight, 64, BLOCK_N) if qkv_weight is not None
                    else (o_w, o_x))

    def per_split(in_features, split, gated=False):
        return triton.cdiv(triton.cdiv(in_features, BOX_K * (1 if gated else 2)), split)

    items = max(parts * o_split, triton.cdiv(intermediate, BLOCK_N),
                parts * down_split, triton.cdiv(qkv_size, BLOCK_N))
    grid = (min(items, programs or num_sms(device.index or 0)),)
    _layer_kernel[grid](
        o_w, o_x, gu_w, gu_x, dn_w, dn_x, qkv_w, qkv_x, hidden, act,
        qkv if qkv is not None else act, partial, arrival_counters(device), ss_o, ss_dn, rows,
        q_size, hidden_size, intermediate, max(qkv_size, BLOCK_N),
        per_split(q_size, o_split), per_split(hidden_size, 1, gated=True),
        per_split(intermediate, down_split), per_split(hidden_size, 1), eps_mlp, eps_qkv,
        SS_PARTS=parts, SS_P2=triton.next_power_of_2(parts), O_SPLIT=o_split,
        DN_SPLIT=down_split, HAS_QKV=qkv_weight is not None, STAGES=STAGES,
        PDL=bool(pdl_options), **VARIANT, trace_ptr=trace if trace is not None else partial,
        TRACE=trace is not None, num_warps=4, **pdl_options)
    return qkv, ss_dn


def launch_separately(attn_out: torch.Tensor, hidden: torch.Tensor, o_weight: torch.Tensor,
                      gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                      qkv_weight: torch.Tensor | None, eps_mlp: float, eps_qkv: float, *,
                      o_split: int, down_split: int, pdl_options: dict
                      ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`launch`'s work as four `linear_gluon` kernels (the path it replaces): same arguments,
    same results, bitwise."""
    from deepinfer.kernels import linear_gluon

    rows = attn_out.shape[0]
    hidden_size = hidden.shape[1]
    intermediate = down_weight.shape[1]
    device = attn_out.device
    parts = triton.cdiv(hidden_size, BLOCK_N)
    ss_o = torch.empty(parts, rows, dtype=torch.float32, device=device)
    ss_dn = torch.empty_like(ss_o)
    act = torch.empty(rows, intermediate, dtype=attn_out.dtype, device=device)
    partial = torch.empty(max(o_split, down_split), rows, hidden_size, dtype=torch.float32,
                          device=device)
    counters = arrival_counters(device)

    def gemm(x, weight, out, ss, ss_parts, split, *, eps=None, gated=False, residual=None):
        linear_gluon.launch(x, weight, None, out, partial, counters, ss, ss_parts, block_m=64,
                            block_n=BLOCK_N, split_k=split, norm_eps=eps, gated=gated,
                            residual=residual, emit_ss=residual is not None, maxima=ss,
                            columns=counters, emit_argmax=False, pdl_options=pdl_options)

    gemm(attn_out, o_weight, hidden, ss_o, 0, o_split, residual=hidden)
    gemm(hidden, gate_up_weight, act, ss_o, parts, 1, eps=eps_mlp, gated=True)
    gemm(act, down_weight, hidden, ss_dn, 0, down_split, residual=hidden)
    if qkv_weight is None:
        return None, ss_dn
    qkv = torch.empty(rows, qkv_weight.shape[0], dtype=attn_out.dtype, device=device)
    gemm(hidden, qkv_weight, qkv, ss_dn, parts, 1, eps=eps_qkv)
    return qkv, ss_dn
