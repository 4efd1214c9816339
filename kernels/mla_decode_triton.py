"""MLA decode in Triton over the paged latent cache, absorbed form, split-K with a reduce.

Design (after FlashMLA's, https://github.com/deepseek-ai/FlashMLA, written anew in Triton):
- Absorbed: the caller folds W_UK into the query (`q_latent_h = q_nope_h W_UK_h`, [L]), so every
  head attends to the one cached latent row `[c_KV ; k_R]` (L + R = 512 + 64 values) and gets
  its output in the latent space (`o_h = sum_t p_ht c_KV_t`, [L]); W_UV is applied after.
- Many heads per program: all heads of a token share one latent row, so program (sequence,
  head tile, split) loads each context tile once for BLOCK_H heads x BLOCK_Q query tokens,
  packed as the BLOCK_H * BLOCK_Q rows of one `tl.dot` (FlashMLA packs h_q * s_q into 64
  rows). The c_KV part of the tile is both the key (with k_R) and the value: read once.
- Multi-token rows: a sequence with 1 + k new tokens (speculative verification) runs as one
  row; query token j sits at position seq_len - q_len + j and sees positions <= its own.
- Split-K ("flash-decoding"): the context of each sequence is cut into NUM_SPLITS slices;
  each program writes an unnormalised partial output with its running max and sum, and the
  reduce kernel merges the slices (log-sum-exp merge); given W_UV, the reduce also projects
  each head's merged latent by it (`_mla_reduce_uv_kernel`, FlashMLA leaves W_UV to the
  caller), so decode needs no W_UV GEMM launch. The split count is a function of host
  ints only (batch size, max_seq_len, SM count), so a captured CUDA graph stays valid for any
  context up to the captured bound; FlashMLA instead balances splits per sequence with a
  scheduler-metadata pass (`get_mla_metadata`), which a future version may add.
- fp32 scores, softmax and accumulation; P is cast to the cache dtype before P @ c_KV (as
  FlashAttention does). float32 inputs use IEEE dot products (tests).

Latent cache layout (one layer): `[num_blocks, block_size, L + R]`, contiguous; slot =
block_id * block_size + offset. Block tables: [num_seqs, max_blocks] int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import backends, pdl
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.settings import DEFAULT, KernelConfig

LOG2E = 1.4426950408889634
UV_BLOCK_V = 32   # value columns per program of the reduce that applies W_UV


@triton.jit
def _mla_decode_kernel(ql_ptr, qp_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
                       out_ptr, part_ptr, ml_ptr, scale_log2, max_q_len,
                       ql_st, ql_sh, qp_st, qp_sh, bt_stride, out_st, out_sh,
                       NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
                       BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, NUM_Q_TILES: tl.constexpr,
                       PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_and_release(PDL, True)   # the next kernel's programs load W_UV while this runs
    seq = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2) // NUM_Q_TILES
    q_tile = tl.program_id(2) % NUM_Q_TILES
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if (q_len > max_q_len) | (q_tile * BLOCK_Q >= q_len):
        return   # a longer chunk (another kernel's), or past this row's query tokens
    seq_len = tl.load(seq_lens_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    m_idx = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + m_idx // BLOCK_H                      # [M] query token in the row
    head = head_tile * BLOCK_H + m_idx % BLOCK_H                  # [M]
    row_ok = (qi < q_len) & (head < NUM_HEADS)
    q_pos = seq_len - q_len + qi                                  # [M] absolute position
    token = (q_start + qi).to(tl.int64)
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    lat_ok = lat < LORA
    rope_ok = rope < ROPE
    q_lat = tl.load(ql_ptr + token[:, None] * ql_st + head[:, None] * ql_sh + lat[None, :],
                    mask=row_ok[:, None] & lat_ok[None, :], other=0.0)     # [M, L]
    q_rope = tl.load(qp_ptr + token[:, None] * qp_st + head[:, None] * qp_sh + rope[None, :],
                     mask=row_ok[:, None] & rope_ok[None, :], other=0.0)   # [M, R]

    # this q tile sees positions [0, ctx_end); split `split` takes its share of the tiles
    ctx_end = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    tiles_per_split = tl.cdiv(tl.cdiv(ctx_end, BLOCK_N), NUM_SPLITS)
    begin = split * tiles_per_split * BLOCK_N
    end = tl.minimum(begin + tiles_per_split * BLOCK_N, ctx_end)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        block_ids = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = (block_ids * BLOCK_SIZE + pos % BLOCK_SIZE) * (LORA + ROPE)   # [N]
        c_kv = tl.load(cache_ptr + rows[:, None] + lat[None, :],
                       mask=valid[:, None] & lat_ok[None, :], other=0.0)    # [N, L]
        k_rope = tl.load(cache_ptr + rows[:, None] + LORA + rope[None, :],
                         mask=valid[:, None] & rope_ok[None, :], other=0.0)  # [N, R]
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=PRECISION)
        s = s * scale_log2                                                  # [M, N] log2 units
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row: no NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=PRECISION)
        m = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + token[:, None] * out_st + head[:, None] * out_sh + lat[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lat_ok[None, :])
    else:
        part_row = (token * NUM_HEADS + head) * NUM_SPLITS + split          # [M]
        tl.store(part_ptr + part_row[:, None] * LORA + lat[None, :], acc,
                 mask=row_ok[:, None] & lat_ok[None, :])
        tl.store(ml_ptr + part_row * 2, m, mask=row_ok)
        tl.store(ml_ptr + part_row * 2 + 1, l, mask=row_ok)


@triton.jit
def _mla_reduce_kernel(part_ptr, ml_ptr, qsl_ptr, out_ptr, max_q_len, out_st, out_sh,
                       NUM_HEADS: tl.constexpr, LORA: tl.constexpr, BLOCK_L: tl.constexpr,
                       NUM_SPLITS: tl.constexpr):
    """Program (sequence, head, query token of the row): merge the splits' partials,
    out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s (empty splits have m_s = -inf)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    qi = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if (q_len > max_q_len) | (qi >= q_len):
        return
    token = (q_start + qi).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    lat = tl.arange(0, BLOCK_L)
    row = (token * NUM_HEADS + head) * NUM_SPLITS + splits              # [S]
    m = tl.load(ml_ptr + row * 2)
    l = tl.load(ml_ptr + row * 2 + 1)
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(weight * l, 0)
    part = tl.load(part_ptr + row[:, None] * LORA + lat[None, :],
                   mask=(lat < LORA)[None, :], other=0.0)               # [S, L]
    out = tl.sum(part * weight[:, None], 0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + token * out_st + head * out_sh + lat, out.to(out_ptr.dtype.element_ty),
             mask=lat < LORA)


@triton.jit
def _mla_reduce_uv_kernel(part_ptr, ml_ptr, qsl_ptr, w_uv_ptr, out_ptr, max_q_len, w_sh, w_sv,
                          out_st, out_sh, NUM_HEADS: tl.constexpr, LORA: tl.constexpr,
                          V_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, NUM_V_TILES: tl.constexpr,
                          PDL: tl.constexpr, RELEASE_EARLY: tl.constexpr):
    """Program (sequence, head, query token x value tile): the splits merged as
    `_mla_reduce_kernel`'s (rounded to the output dtype, as the unfused path stores it), then
    projected by W_UV: out[v] = sum_l o[l] W_UV[head, v, l] for the tile's BLOCK_V values,
    float32 accumulation. The W_UV tile (a weight: no kernel writes it) is loaded before the
    PDL wait, while the decode kernel runs; empty splits (m = -inf) are not read.
    RELEASE_EARLY: the next kernel (o_proj's GEMM) may launch right after the wait
    (`KernelConfig.pdl_release_early` names "mla_reduce"), else when this one ends."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    qi = tl.program_id(2) // NUM_V_TILES
    v = (tl.program_id(2) % NUM_V_TILES) * BLOCK_V + tl.arange(0, BLOCK_V)
    lat = tl.arange(0, BLOCK_L)
    lat_ok = lat < LORA
    w = tl.load(w_uv_ptr + head * w_sh + v[:, None] * w_sv + lat[None, :],
                mask=(v < V_DIM)[:, None] & lat_ok[None, :], other=0.0)        # [V, L]
    pdl.wait_and_release(PDL, RELEASE_EARLY)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if (q_len > max_q_len) | (qi >= q_len):
        return
    token = (q_start + qi).to(tl.int64)
    row = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)    # [S]
    m = tl.load(ml_ptr + row * 2)
    l = tl.load(ml_ptr + row * 2 + 1)
    live = m != float("-inf")
    weight = tl.where(live, tl.exp2(m - tl.max(m, 0)), 0.0)
    weight = weight / tl.maximum(tl.sum(weight * l, 0), 1e-30)                   # [S]
    part = tl.load(part_ptr + row[:, None] * LORA + lat[None, :],
                   mask=live[:, None] & lat_ok[None, :], other=0.0)              # [S, L]
    dtype = out_ptr.dtype.element_ty
    o_lat = tl.sum(part * weight[:, None], 0).to(dtype).to(tl.float32)          # [L]
    out = tl.sum(w.to(tl.float32) * o_lat[None, :], 1)                          # [V]
    tl.store(out_ptr + token * out_st + head * out_sh + v, out.to(dtype), mask=v < V_DIM)


def num_splits(num_seqs: int, head_tiles: int, max_seq_len: int, num_sms: int,
               settings: KernelConfig) -> int:
    """Split-K partitions: enough programs for `settings.mla_decode_waves` waves over the SMs,
    no more splits than context tiles, at most `mla_decode_max_splits`, a power of two.
    Host ints only (graph-safe)."""
    programs = num_seqs * head_tiles
    wanted = -(-settings.mla_decode_waves * num_sms // programs)
    useful = -(-max_seq_len // settings.mla_decode_block_n)
    splits = max(1, min(wanted, useful, settings.mla_decode_max_splits))
    return triton.next_power_of_2(splits) if splits > 1 else 1


def latent_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float, *, max_q_len: int,
                     block_q: int | None = None, block_rows: int | None = None,
                     splits: int | None = None, heads_major: bool = False,
                     w_uv: torch.Tensor | None = None,
                     settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """Causal attention in the latent space for the sequences with at most `max_q_len` new
    tokens (rows of longer sequences are left untouched in the result).

    Args:
        q_latent: [num_tokens, H, L] (q_nope W_UK; any token/head strides, unit last stride).
        q_pe: [num_tokens, H, R], rotated, unit last stride.
        kv_cache: [num_blocks, block_size, L + R], q's dtype, contiguous.
        metadata: query_start_loc [num_seqs + 1] int32, seq_lens [num_seqs] int32,
            block_tables [num_seqs, max_blocks] int32; host ints num_seqs / max_seq_len.
        scale: softmax scale (of the expanded form's q.k).
        max_q_len: host int, the longest row this call serves (1 for plain decode).
        block_q: query tokens per program (default: next power of two >= max_q_len); a smaller
            value tiles long rows over programs (absorbed prefill).
        block_rows: rows (heads x query tokens) per program (default:
            `settings.mla_decode_block_h`).
        splits: split-K partitions (default: `num_splits`).
        heads_major: store the result as [H, num_tokens, L] memory (returned as its
            [num_tokens, H, L] view), ready for the W_UV batched GEMM.
        w_uv: [H, Dv, L] (unit last stride): project each head's output by it in the split
            reduce (`_mla_reduce_uv_kernel`: the W_UV GEMM's launch saved; at least two
            splits, so the reduce always runs).
    Returns:
        [num_tokens, H, L], q_latent's dtype: softmax(q k^T) c_KV per token and head; with
        `w_uv`, [num_tokens, H, Dv] contiguous: that times W_UV[h]^T.
    """
    num_tokens, num_heads, lora = q_latent.shape
    rope = q_pe.shape[2]
    if w_uv is not None:
        out = torch.empty(num_tokens, num_heads, w_uv.shape[1], dtype=q_latent.dtype,
                          device=q_latent.device)
    else:
        shape = (num_heads, num_tokens, lora) if heads_major else (num_tokens, num_heads, lora)
        out = torch.empty(shape, dtype=q_latent.dtype, device=q_latent.device)
        out = out.transpose(0, 1) if heads_major else out
    if num_tokens == 0:
        return out
    block_q = block_q or triton.next_power_of_2(max_q_len)
    # rows per program (heads x query tokens) stay ~mla_decode_block_h; tl.dot needs >= 16
    block_h = min(max(1, (block_rows or settings.mla_decode_block_h) // block_q),
                  triton.next_power_of_2(num_heads))
    block_h = max(block_h, -(-16 // block_q))
    head_tiles = triton.cdiv(num_heads, block_h)
    num_q_tiles = triton.cdiv(max_q_len, block_q)
    sms = backends.num_sms(q_latent.device.index or 0) if q_latent.is_cuda else 8
    if splits is None:
        splits = num_splits(metadata.num_seqs * num_q_tiles, head_tiles, metadata.max_seq_len,
                            sms, settings)
    if w_uv is not None:
        splits = max(2, splits)
    part = ml = out   # placeholders: one split writes the output directly
    if splits > 1:
        part = torch.empty(num_tokens * num_heads * splits, lora, dtype=torch.float32,
                           device=q_latent.device)
        ml = torch.empty(num_tokens * num_heads * splits * 2, dtype=torch.float32,
                         device=q_latent.device)
    fp32 = q_latent.dtype == torch.float32
    pdl_options = pdl.launch_options(q_latent.device, settings)
    _mla_decode_kernel[(metadata.num_seqs, head_tiles, splits * num_q_tiles)](
        q_latent, q_pe, kv_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, out, part, ml, scale * LOG2E, max_q_len,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        metadata.block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, LORA=lora, ROPE=rope, BLOCK_L=triton.next_power_of_2(lora),
        BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=settings.mla_decode_block_n,
        NUM_SPLITS=splits, NUM_Q_TILES=num_q_tiles, PRECISION="ieee" if fp32 else "tf32",
        PDL=bool(pdl_options),
        num_warps=settings.mla_decode_warps * max(1, block_q * block_h // 32),
        num_stages=settings.mla_decode_stages, **pdl_options)
    if w_uv is not None:
        if w_uv.stride(2) != 1:
            raise ValueError("w_uv must have a unit last stride ([H, Dv, L] rows of kv_b_proj).")
        v_dim = w_uv.shape[1]
        v_tiles = triton.cdiv(v_dim, UV_BLOCK_V)
        _mla_reduce_uv_kernel[(metadata.num_seqs, num_heads, max_q_len * v_tiles)](
            part, ml, metadata.query_start_loc, w_uv, out, max_q_len, w_uv.stride(0),
            w_uv.stride(1), out.stride(0), out.stride(1), NUM_HEADS=num_heads, LORA=lora,
            V_DIM=v_dim, BLOCK_L=triton.next_power_of_2(lora), BLOCK_V=UV_BLOCK_V,
            NUM_SPLITS=splits, NUM_V_TILES=v_tiles, PDL=bool(pdl_options),
            RELEASE_EARLY=not pdl.release_after_loop("mla_reduce", settings=settings),
            num_warps=8, **pdl_options)
    elif splits > 1:
        _mla_reduce_kernel[(metadata.num_seqs, num_heads, max_q_len)](
            part, ml, metadata.query_start_loc, out, max_q_len, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, LORA=lora, BLOCK_L=triton.next_power_of_2(lora),
            NUM_SPLITS=splits, num_warps=4)
    return out
