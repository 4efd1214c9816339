"""Fused MoE experts in Triton: on-device token->expert alignment, a grouped GEMM over experts
for gate_up with SiLU-and-mul in its epilogue, a grouped GEMM for down with the routing weights
applied, and the combine back to token order. No host sync and every size a static bound of
the input shapes, so a CUDA graph can hold the whole call.

Design (after vLLM / SGLang `fused_moe`: tokens sorted by expert and padded per expert to the
GEMM's row tile, one program per (row tile, column tile) reading its tile's expert id; our own
code, with these departures):
1. Alignment without a sort. Up to `KernelConfig.moe_align_one_program_max_pairs` (token, k)
   pairs (decode) one program does it all: per-expert counts and each pair's rank inside its
   expert (in pair order) from the [pairs, experts] one-hot matrix and its cumulative sum,
   padded offsets, each row tile's expert (-1 for unused tiles), the pairs scattered to
   `padded_start[e] + rank`. Above (prefill), `_rank_kernel` gives each pair its rank with an
   atomic increment of a zeroed per-expert count and `_layout_kernel` spreads the rest over
   programs of CHUNK row tiles / slots / pairs each (one program over 49k pairs took ~0.4 ms
   per layer). Padding slots get the sentinel `num_pairs`, real slots a pair: the two write
   sets are disjoint and need no barrier. The atomic rank order varies run to run, but a GEMM
   row's result does not depend on which row of its tile it sits in, and the combine sums each
   token's k results in k order: the output is deterministic.
2. The row-tile count is the static bound `cdiv(P + min(E, P) * (BLOCK_M - 1), BLOCK_M)` for
   P = tokens * top_k pairs and E experts (each hit expert wastes < BLOCK_M rows), not
   `P + E * (BLOCK_M - 1)`: at decode (P = 6, E = 64) that is 6 row tiles instead of 61.
3. gate_up runs both halves in one program (two accumulators over the same A tile), so the
   SiLU-and-mul is the epilogue and the [P, 2I] gate_up output never exists; the down GEMM
   multiplies by the routing weight (float32) and writes each pair's row in the model dtype
   (as vLLM's), and `_combine_kernel` sums each token's top_k rows in order in float32 (no
   float atomics: deterministic), plus the shared experts' output where the caller passes it
   (one add kernel less per layer).

Tile choice: `KernelConfig.moe_tiles` (kernels/settings.py), picked by the mean rows per expert;
`KernelConfig.moe_pair_tile` on the pair-tiles path.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm_triton import quantize_activation
from deepinfer.kernels.settings import DEFAULT, KernelConfig, MoETile

MAX_EXPERTS = 1024   # the alignment holds one count per expert in registers


@triton.jit
def _padded_ranges(counts, BLOCK_M: tl.constexpr):
    """Each expert's run of slots [start, end), padded to a multiple of BLOCK_M, and the total."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)                    # [E_PAD] exclusive end
    return padded_end - padded, padded_end, tl.sum(padded, axis=0)


@triton.jit
def _write_layout(sorted_ptr, block_expert_ptr, counts, padded_start, padded_end, total,
                  e_mask, first, num_pairs, num_slots, num_blocks, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr):
    """The experts of row tiles [first, first + CHUNK) and the sentinel `num_pairs` in the
    padding slots among slots [first, first + CHUNK)."""
    # each row tile's expert: the number of experts whose padded range ends at or before it
    b = first + tl.arange(0, CHUNK)
    row = b * BLOCK_M
    ends = tl.where(e_mask[None, :], padded_end[None, :], 1 << 30)
    expert = tl.sum((ends <= row[:, None]).to(tl.int32), axis=1)
    expert = tl.where(row < total, expert, -1)
    tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)
    # padding slots (inside a hit expert's last tile, or past the used tiles) get the sentinel
    s = first + tl.arange(0, CHUNK)
    inside = (s[:, None] >= padded_start[None, :]) & (s[:, None] < padded_end[None, :])
    local = s[:, None] - padded_start[None, :]
    real = tl.sum((inside & (local < counts[None, :])).to(tl.int32), axis=1)
    tl.store(sorted_ptr + s, tl.full([CHUNK], 0, tl.int32) + num_pairs,
             mask=(s < num_slots) & (real == 0))


@triton.jit
def _align_one_program_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts,
                              num_slots, num_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                              P_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """The whole alignment of a few pairs in one program: counts and ranks (in pair order)
    from the [pairs, experts] one-hot matrix, no atomics, no counters."""
    pdl.wait_and_release(PDL, True)
    p = tl.arange(0, P_PAD)
    p_ok = p < num_pairs
    e_offs = tl.arange(0, E_PAD)
    e_mask = e_offs < num_experts
    expert = tl.load(ids_ptr + p, mask=p_ok, other=E_PAD).to(tl.int32)
    onehot = (expert[:, None] == e_offs[None, :]).to(tl.int32)   # [P_PAD, E_PAD]
    counts = tl.sum(onehot, axis=0)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    padded_start, padded_end, total = _padded_ranges(counts, BLOCK_M)
    for first in range(0, num_slots, CHUNK):   # num_slots >= num_blocks
        _write_layout(sorted_ptr, block_expert_ptr, counts, padded_start, padded_end, total,
                      e_mask, first, num_pairs, num_slots, num_blocks, BLOCK_M=BLOCK_M,
                      CHUNK=CHUNK)
    base = tl.sum(onehot * padded_start[None, :], axis=1)
    tl.store(sorted_ptr + base + rank, p.to(tl.int32), mask=p_ok)


@triton.jit
def _rank_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    pdl.wait_and_release(PDL, True)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=mask)
    tl.store(rank_ptr + offs, rank, mask=mask)


@triton.jit
def _layout_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                   num_experts, num_slots, num_blocks, BLOCK_M: tl.constexpr,
                   E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program i: row tiles, slots and pairs [i * CHUNK, (i + 1) * CHUNK), from the counts
    `_rank_kernel` completed."""
    pdl.wait_and_release(PDL, True)
    first = tl.program_id(0) * CHUNK
    e_offs = tl.arange(0, E_PAD)
    e_mask = e_offs < num_experts
    counts = tl.load(counts_ptr + e_offs, mask=e_mask, other=0)
    padded_start, padded_end, total = _padded_ranges(counts, BLOCK_M)
    _write_layout(sorted_ptr, block_expert_ptr, counts, padded_start, padded_end, total, e_mask,
                  first, num_pairs, num_slots, num_blocks, BLOCK_M=BLOCK_M, CHUNK=CHUNK)
    # real slots get their pair
    p = first + tl.arange(0, CHUNK)
    p_mask = p < num_pairs
    expert = tl.load(ids_ptr + p, mask=p_mask, other=0)
    rank = tl.load(rank_ptr + p, mask=p_mask, other=0)
    base = tl.sum(tl.where(e_offs[None, :] == expert[:, None], padded_start[None, :], 0), axis=1)
    tl.store(sorted_ptr + base + rank, p.to(tl.int32), mask=p_mask)


@triton.jit
def _quantize_rows(a):
    """One 128-wide K block of activations quantized per row (DeepGEMM's recipe): (e4m3 codes,
    float32 row scales amax / 448)."""
    a = a.to(tl.float32)
    a_scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10) / 448.0
    return tl.clamp(a / a_scale[:, None], -448.0, 448.0).to(tl.float8e4nv), a_scale


@triton.jit
def _fp8_a_block(a, scale_ptrs, row_ok, A_FP8: tl.constexpr):
    """One 128-wide K block of the activations as (e4m3 codes, float32 row scales): `a` as
    loaded, with A_FP8 already the codes and their scales at `scale_ptrs` ([BLOCK_M] pointers,
    masked by row_ok), else quantized here (`_quantize_rows`)."""
    if A_FP8:
        return a, tl.load(scale_ptrs, mask=row_ok, other=0.0)
    else:
        return _quantize_rows(a)


@triton.jit
def _fp8_block_dot(a8, a_scale, w, w_scale, acc):
    """acc + (a . w) for one 128-wide K block: the e4m3 x e4m3 dot in fp32, times the row
    scales and the weight block's scale `w_scale`."""
    return acc + tl.dot(a8, w, out_dtype=tl.float32) * (a_scale[:, None] * w_scale)


@triton.jit
def _tile_ids(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program: groups of GROUP_M row tiles (0: all of them),
    a group's row tiles side by side for one column tile, then the next column tile."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group_m = GROUP_M if GROUP_M > 0 else num_blocks
    first_m = pid // (group_m * num_n) * group_m
    size_m = tl.minimum(num_blocks - first_m, group_m)
    within = pid % (group_m * num_n)
    return first_m + within % size_m, within // size_m


@triton.jit
def _tile_pairs(sorted_ptr, offs_m, pid_m, num_pairs, BLOCK_M: tl.constexpr,
                PAIR_TILES: tl.constexpr):
    """[BLOCK_M] pair index of each slot of row tile pid_m (num_pairs on padding slots)."""
    if PAIR_TILES:
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        pair = tl.load(sorted_ptr + offs_m)
    return pair


@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                    num_pairs, num_blocks, N, K, stride_xm, stride_xsm, stride_we, stride_wn,
                    stride_se, stride_sn, stride_om, TOP_K: tl.constexpr,
                    PRECISION: tl.constexpr, FP8: tl.constexpr, A_FP8: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, PAIR_TILES: tl.constexpr, SWAP_AB: tl.constexpr,
                    PDL: tl.constexpr):
    """out[slot, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]) for the tile's slots.
    FP8: w is e4m3 with s [E, 2N / 128, K / 128] float32 block scales (BLOCK_K = 128); the
    activations are quantized per row and K block in the loop, or with A_FP8 arrive quantized
    (x e4m3, xs [tokens, K / 128] float32 scales: `_fp8_a_block`).
    PAIR_TILES: row tile b holds pair b alone, block_expert_ptr is the pairs' expert ids.
    SWAP_AB (bf16 / fp32 only): the accumulators are [BLOCK_N, BLOCK_M] = w . x^T, the weight
    tile the MMA's M side (a few rows: BLOCK_N >= 64 fills Hopper's 64-row MMA, BLOCK_M does not)."""
    pdl.wait(PDL)
    pid_m, pid_n = _tile_ids(num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = _tile_pairs(sorted_ptr, offs_m, pid_m, num_pairs, BLOCK_M, PAIR_TILES)
    row_ok = pair < num_pairs
    token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if SWAP_AB:   # [BLOCK_N, BLOCK_K] weight tiles, accumulators [BLOCK_N, BLOCK_M]
        g_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:         # [BLOCK_K, BLOCK_N] weight tiles, accumulators [BLOCK_M, BLOCK_N]
        g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u_ptrs = g_ptrs + N * stride_wn
    acc_u = tl.zeros_like(acc_g)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if SWAP_AB:
            w_mask = n_ok[:, None] & k_ok[None, :]
        else:
            w_mask = k_ok[:, None] & n_ok[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if FP8:   # the activations quantized once for both dots
            a8, a_scale = _fp8_a_block(a, xs_ptr + token * stride_xsm + k, row_ok, A_FP8)
            s_row = s_ptr + expert.to(tl.int64) * stride_se + k
            acc_g = _fp8_block_dot(a8, a_scale, g,
                                   tl.load(s_row + (pid_n * BLOCK_N // 128) * stride_sn), acc_g)
            acc_u = _fp8_block_dot(a8, a_scale, u,
                                   tl.load(s_row + ((N + pid_n * BLOCK_N) // 128) * stride_sn),
                                   acc_u)
        elif SWAP_AB:
            acc_g = tl.dot(g, tl.trans(a), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(u, tl.trans(a), acc_u, input_precision=PRECISION)
        else:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    pdl.launch_dependents(PDL)
    act = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(out_ptr.dtype.element_ty)
    if SWAP_AB:
        o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(o_ptrs, act, mask=n_ok[:, None])
    else:
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, act, mask=n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, as_ptr, w_ptr, s_ptr, y_ptr, weights_ptr, sorted_ptr,
                 block_expert_ptr, num_pairs, num_blocks, N, K, stride_am, stride_asm,
                 stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                 PRECISION: tl.constexpr, FP8: tl.constexpr, A_FP8: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, PAIR_TILES: tl.constexpr, SWAP_AB: tl.constexpr,
                 PDL: tl.constexpr):
    """y[pair, n] = weight[pair] * (a[slot] . w[e, n]) (fp32 product, stored in y's dtype),
    for the tile's real slots (PAIR_TILES, SWAP_AB, FP8, A_FP8 (as [slots, K / 128] scales):
    as `_gate_up_kernel`)."""
    pdl.wait(PDL)
    pid_m, pid_n = _tile_ids(num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = _tile_pairs(sorted_ptr, offs_m, pid_m, num_pairs, BLOCK_M, PAIR_TILES)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if SWAP_AB:
        w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :]   # [BLOCK_N, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]   # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if FP8:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            a8, a_scale = _fp8_a_block(a, as_ptr + offs_m.to(tl.int64) * stride_asm + k,
                                       offs_m >= 0, A_FP8)
            acc = _fp8_block_dot(a8, a_scale, w, tl.load(s_ptr + expert.to(tl.int64) * stride_se
                                                          + k + (pid_n * BLOCK_N // 128)
                                                          * stride_sn), acc)
        elif SWAP_AB:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    pdl.launch_dependents(PDL)
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    if SWAP_AB:
        y_ptrs = y_ptr + pair[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, (acc * weight[None, :]).to(y_ptr.dtype.element_ty),
                 mask=row_ok[None, :] & n_ok[:, None])
    else:
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, (acc * weight[:, None]).to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, add_ptr, out_ptr, N, stride_add, TOP_K: tl.constexpr,
                    HAS_ADD: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[t, n] = add[t, n] (HAS_ADD) + sum over k in order of y[t * TOP_K + k, n]."""
    pdl.wait_and_release(PDL, True)
    token, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + token * stride_add + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + k) * N + offs_n, mask=n_ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def pick_tile(num_pairs: int, num_experts: int, settings: KernelConfig) -> MoETile:
    """The first `settings.moe_tiles` entry whose max_rows >= the mean rows per expert."""
    mean_rows = num_pairs / num_experts
    for tile in settings.moe_tiles:
        if mean_rows <= tile.max_rows:
            return tile
    return settings.moe_tiles[-1]


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
          settings: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sort (token, k) pairs by expert, each expert's run padded to a multiple of block_m.

    Up to `settings.moe_align_one_program_max_pairs` pairs: one program, pairs of an expert in pair order
    (`_align_one_program_kernel`); above: a zeroed count per expert, `_rank_kernel` (atomic
    ranks, order inside an expert varies run to run) and the parallel `_layout_kernel`.

    Args:
        topk_ids: [num_tokens, top_k] integer physical expert ids in [0, num_experts).
    Returns:
        (sorted_pairs [num_slots] int32: flat pair index t * top_k + k, or num_pairs on a
        padding slot; block_expert [num_blocks] int32: each row tile's expert, -1 past the
        used tiles; num_blocks), num_slots = num_blocks * block_m a static bound of the shapes.
    Raises:
        ValueError: more than MAX_EXPERTS experts.
    """
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"{num_experts} physical experts; the Triton MoE handles up to "
                         f"{MAX_EXPERTS}.")
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    num_slots = num_blocks * block_m
    sorted_pairs = torch.empty(num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 8192 // e_pad))
    options = pdl.launch_options(device, settings)
    if num_pairs <= settings.moe_align_one_program_max_pairs:
        p_pad = max(16, triton.next_power_of_2(num_pairs))
        _align_one_program_kernel[(1,)](
            ids, sorted_pairs, block_expert, num_pairs, num_experts, num_slots, num_blocks,
            BLOCK_M=block_m, E_PAD=e_pad, P_PAD=p_pad, CHUNK=chunk, PDL=bool(options),
            num_warps=4 if p_pad * e_pad <= 8192 else 8, **options)
        return sorted_pairs, block_expert, num_blocks
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    _rank_kernel[(triton.cdiv(num_pairs, 1024),)](ids, counts, rank, num_pairs, BLOCK=1024,
                                                  PDL=bool(options), **options)
    _layout_kernel[(triton.cdiv(num_slots, chunk),)](
        ids, counts, rank, sorted_pairs, block_expert, num_pairs, num_experts, num_slots,
        num_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, PDL=bool(options),
        num_warps=4, **options)
    return sorted_pairs, block_expert, num_blocks


_SHARED_MEMORY_BYTES = 200 * 1024   # Hopper allows 227 KiB per block; room for the epilogue


def _stages_that_fit(tile, activation_bytes: int, weight_bytes: int) -> int:
    """The most pipeline stages (at most `tile.num_stages`) whose gate_up tiles - one
    [block_m, block_k] activation tile and two [block_n, block_k] weight tiles per stage, of
    `activation_bytes` / `weight_bytes` per element, Triton buffering num_stages - 1 of them -
    fit in `_SHARED_MEMORY_BYTES` (a tile tuned for bf16 run on float32 weights needs fewer)."""
    stage = (tile.block_m * activation_bytes + 2 * tile.block_n * weight_bytes) * tile.block_k
    return max(1, min(tile.num_stages, 1 + _SHARED_MEMORY_BYTES // stage))


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                shared_output: torch.Tensor | None = None,
                shared_ready: torch.cuda.Event | None = None,
                settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """Same contract as `kernels.reference.moe.moe_experts` (CUDA tensors, or any device under
    TRITON_INTERPRET=1), plus `shared_output` ([num_tokens, hidden_size] or None) added in the
    combine; four kernel launches at decode (alignment in one program), three up to
    `settings.moe_pair_tiles_max_tokens` tokens (no alignment: each (token, k) pair is its own
    row tile, which at one token, whose k experts are distinct, reads no expert twice), no host
    sync.
    `shared_ready`: an event recorded after the kernels writing shared_output on another
    stream; the current stream waits for it just before the combine (so the shared experts
    run concurrently with the alignment and the expert GEMMs).

    FP8 experts: w13 / w2 in float8_e4m3fn with w13_scale [E, 2I / 128, H / 128] and w2_scale
    [E, H / 128, I / 128] float32 128x128 block scales (DeepSeek-V3's `weight_scale_inv`);
    I and H multiples of 128. Activations are quantized per row and 128-channel block
    (DeepGEMM's recipe): inside the GEMMs' K loops, or from
    `settings.moe_fp8_quantize_once_pairs` pairs once before each GEMM; accumulation in
    float32.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, hidden_size = w13.shape
    inter = inter2 // 2
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    hidden = hidden.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13 and w2 must be row-major in their last dim")
    fp8 = w13_scale is not None
    num_pairs = num_tokens * top_k
    pair_tiles = (num_tokens <= settings.moe_pair_tiles_max_tokens
                  and not settings.batch_invariant)
    if settings.batch_invariant:   # one tile whatever the rows: a pair's sums never change
        tile = settings.moe_invariant_tile
    else:
        tile = settings.moe_pair_tile if pair_tiles else pick_tile(num_pairs, num_experts,
                                                                   settings)
    if fp8:
        if inter % 128 or hidden_size % 128 or w2_scale is None:
            raise ValueError("FP8 experts need intermediate and hidden sizes that are multiples "
                             "of 128 and both block-scale tensors")
        # one K step per 128-wide scale block; column tiles inside one scale block
        tile = dataclasses.replace(tile, block_k=128, block_n=min(tile.block_n, 128),
                                   down_block_n=min(tile.down_block_n, 128), swap_ab=False)
    # float32 models (the parity tests) multiply in full precision, not TF32
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    tile = dataclasses.replace(tile, num_stages=_stages_that_fit(tile, hidden.element_size(),
                                                                 w13.element_size()))
    if pair_tiles:   # no alignment: row tile b is pair b (one token's k experts are distinct)
        block_expert = topk_ids.reshape(-1).contiguous()
        sorted_pairs, num_blocks = block_expert, num_pairs   # sorted_pairs unused
    else:
        sorted_pairs, block_expert, num_blocks = align(topk_ids, num_experts, tile.block_m,
                                                       settings)
    options = pdl.launch_options(hidden.device, settings)
    act = torch.empty(num_blocks * tile.block_m, inter, dtype=hidden.dtype, device=hidden.device)
    s13 = w13_scale if fp8 else w13
    # FP8 from moe_fp8_quantize_once_pairs pairs: each GEMM's activations quantized once, not
    # in every column tile's K loop (batch-invariant mode: one path at every size)
    a_fp8 = (fp8 and not settings.batch_invariant
             and num_pairs >= settings.moe_fp8_quantize_once_pairs)
    x, xs = quantize_activation(hidden) if a_fp8 else (hidden, hidden)
    grid = (num_blocks * triton.cdiv(inter, tile.block_n),)
    _gate_up_kernel[grid](x, xs, w13, s13, act, sorted_pairs, block_expert, num_pairs,
                          num_blocks, inter, hidden_size, x.stride(0), xs.stride(0),
                          w13.stride(0), w13.stride(1), s13.stride(0) if fp8 else 0,
                          s13.stride(1) if fp8 else 0, act.stride(0), TOP_K=top_k,
                          PRECISION=precision, FP8=fp8, A_FP8=a_fp8, BLOCK_M=tile.block_m,
                          BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                          PAIR_TILES=pair_tiles, SWAP_AB=tile.swap_ab, PDL=bool(options),
                          num_warps=tile.num_warps, num_stages=tile.num_stages, **options)
    y = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    s2 = w2_scale if fp8 else w2
    act, act_scales = quantize_activation(act) if a_fp8 else (act, act)
    grid = (num_blocks * triton.cdiv(hidden_size, tile.down_block_n),)
    _down_kernel[grid](act, act_scales, w2, s2, y, weights, sorted_pairs, block_expert,
                       num_pairs, num_blocks, hidden_size, inter, act.stride(0),
                       act_scales.stride(0), w2.stride(0), w2.stride(1),
                       s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0,
                       y.stride(0), PRECISION=precision, FP8=fp8, A_FP8=a_fp8,
                       BLOCK_M=tile.block_m,
                       BLOCK_N=tile.down_block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                       PAIR_TILES=pair_tiles, SWAP_AB=tile.swap_ab, PDL=bool(options),
                       num_warps=tile.num_warps, num_stages=tile.num_stages, **options)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    block_n = min(1024, triton.next_power_of_2(hidden_size))
    if shared_ready is not None:
        torch.cuda.current_stream(hidden.device).wait_event(shared_ready)
    if shared_output is not None and shared_output.stride(-1) != 1:
        shared_output = shared_output.contiguous()
    add = shared_output if shared_output is not None else out
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
        y, add, out, hidden_size, add.stride(0), TOP_K=top_k,
        HAS_ADD=shared_output is not None, BLOCK_N=block_n, PDL=bool(options), num_warps=4,
        **options)
    return out
