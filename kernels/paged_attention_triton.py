"""Paged attention and KV write in Triton: the CUDA backend ("triton").

Three kernels, each reading the paged cache in place through the block tables (no gather copy):

- `_write_kv_kernel`: one program per new token stores its K and V at `slot_mapping[t]`; a slot
  of -1 is skipped inside the kernel (no host check, so it is safe in a CUDA graph).
- `_decode_kernel` + `_decode_reduce_kernel`: one new token per sequence. Split-K
  ("flash-decoding", Dao et al. 2023, https://pytorch.org/blog/flash-decoding/): program
  (sequence, kv head, split) attends the group's G query heads to one slice of the context with
  an online softmax (Milakov & Gimelshein 2018), writing an unnormalised partial output with its
  running max and sum; the reduce kernel combines the splits. The split count depends only on
  the batch size and `metadata.max_seq_len` (host ints), so a captured CUDA graph stays valid for
  any context up to that bound. With one split the decode kernel writes the output itself.
- `_rows_kernel` (+ the same reduce): rows of a few new tokens each (speculative verify rows
  of 1 + k tokens, up to `ROWS_MAX_QUERY_LEN`): the decode kernel's split-K, with program
  (sequence, kv head, split) attending all the row's query tokens x the group's query heads
  (BLOCK_Q x BLOCK_G rows, causal by each token's position) to one slice of the context, so
  the context is read once per kv head and split over the SMs at batch 1 (FlashMLA's idea
  for MLA: every head and query token of a row share the context rows it loads). The prefill
  kernel gave such a row one program per query head walking the whole context alone.
- `_prefill_kernel`: varlen causal attention (FlashAttention-2's loop, Dao 2023) for batches
  with several new tokens per sequence: program (query tile, sequence, query head) walks the
  context, cached prefix and this step's tokens alike, through the block table; query token j of
  sequence i sits at position seq_len_i - query_len_i + j. Mixed batches (prefill chunks and
  decode tokens) run here in one launch.

- `_token_kernel`: the batch-invariant form (`paged_attention(..., every_token=True)`,
  `KernelConfig.batch_invariant`): program (token, kv head) attends the group's query heads of
  one new token to its whole context [0, position], BLOCK_N positions at a time in order, with
  no split, so a token's bits depend on its own query and context only: the same as a decode
  token, inside a prefill chunk of any length, or in a verify row, whatever else is batched.
  Prefill is slower than `_prefill_kernel` (each token re-reads its context; L2 absorbs most).

Numerics: scores, softmax and accumulation in float32; P is cast to the cache dtype before the
P @ V product (as FlashAttention does). float32 inputs use IEEE dot products (no tf32), so the
float32 path matches the torch reference to ~1e-5.

KV cache layout (one layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, contiguous;
index 0 = K, 1 = V; slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import backends
from deepinfer.kernels.attention_metadata import AttentionMetadata

DECODE_BLOCK_N = 64      # context tokens per decode tile
DECODE_LAUNCH = (4, 2)   # (num_warps, num_stages): swept in run 12 (benchmarks/RESULTS.md)
MAX_SPLITS = 32          # split-K partitions at most (a power of two)
WAVES = 2                # split so that the programs fill ~this many waves over the SMs
ROWS_MAX_QUERY_LEN = 16  # rows of at most this many new tokens run `_rows_kernel`
ROWS_MAX_TILE = 64       # ... when BLOCK_Q x BLOCK_G query rows fit one tile of this many


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, key_stride_t, key_stride_h,
                     value_stride_t, value_stride_h, v_offset,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & ((slot + 0 * heads) >= 0)  # [H, D]
    key = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask)
    dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    tl.store(dst, key, mask=mask)
    tl.store(dst + v_offset, value, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V at its slot, in place (contract in kernels/paged_attention).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype; unit stride along
            head_dim (strided views of a fused projection are fine).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        slot_mapping: [num_tokens] int64; -1 = do not write this token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    check_cache(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), kv_cache[0].numel(), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit
def attend_context(q, cache_ptr, table, begin, end, kv_head, d, d_ok, scale, v_offset, q_pos,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Online-softmax attention of q ([R, D] rows: a decode step's query heads of `kv_head`,
    or a prefill tile's queries of one head) to the cached positions [begin, end) read through
    the block table row `table`, BLOCK_N at a time. CAUSAL: row r sees positions <= q_pos[r]
    ([R] int32; unused otherwise), and a row that sees nothing in a tile keeps m = -inf.
    Returns (running max m [R], running sum l [R], unnormalised output acc [R, D]), float32;
    m = -inf, l = 0, acc = 0 for an empty range."""
    m = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        block_ids = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = (block_ids * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
        offsets = rows[:, None] * HEAD_DIM + d[None, :]                # [N, D]
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, N] fp32
        if CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        if CAUSAL:   # a fully masked row: exp(-inf - -inf) would be NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_ptr, m_ptr,
                   l_ptr, scale, q_stride_t, q_stride_h, bt_stride, out_stride_t, out_stride_h,
                   v_offset, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    begin = split * tiles_per_split * BLOCK_N
    end = tl.minimum(begin + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g                                        # [G] query heads
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=(g < GROUP)[:, None] & d_ok[None, :], other=0.0)  # [G, D]
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    m, l, acc = attend_context(q, cache_ptr, table, begin, end, kv_head, d, d_ok, scale,
                                v_offset, seq_len, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                                PRECISION, CAUSAL=False)

    head_ok = (g < GROUP)[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok)
    else:
        row = (seq * NUM_Q_HEADS + heads) * NUM_SPLITS + split         # [G]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=head_ok)
        tl.store(m_ptr + row, m, mask=g < GROUP)
        tl.store(l_ptr + row, l, mask=g < GROUP)


@triton.jit
def _rows_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
                 part_ptr, m_ptr, l_ptr, scale, q_stride_t, q_stride_h, bt_stride, out_stride_t,
                 out_stride_h, v_offset, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if query_len == 0:   # an empty row (a CUDA graph's padding): no token to write
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    begin = split * tiles_per_split * BLOCK_N
    end = tl.minimum(begin + tiles_per_split * BLOCK_N, seq_len)

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    j = r // BLOCK_G                                                   # query token of row r
    g = r % BLOCK_G                                                    # its head in the group
    row_ok = (j < query_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    tokens = (q_start + j).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tokens[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=mask, other=0.0)                                  # [Q * G, D]
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    m, l, acc = attend_context(q, cache_ptr, table, begin, end, kv_head, d, d_ok, scale,
                                v_offset, seq_len - query_len + j, NUM_KV_HEADS, HEAD_DIM,
                                BLOCK_SIZE, BLOCK_N, PRECISION, CAUSAL=True)
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + tokens[:, None] * out_stride_t + heads[:, None] * out_stride_h
                 + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:   # partials by token, as the decode kernel's by sequence: the same reduce
        row = (tokens * NUM_Q_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
        tl.store(m_ptr + row, m, mask=row_ok)
        tl.store(l_ptr + row, l, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(part_ptr, m_ptr, l_ptr, out_ptr, out_stride_t, out_stride_h,
                          NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    row = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + splits             # [S]
    m = tl.load(m_ptr + row)
    l = tl.load(l_ptr + row)
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))      # empty splits weigh 0
    total = tl.sum(weight * l, 0)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :],
                   mask=(d < HEAD_DIM)[None, :], other=0.0)            # [S, D]
    out = tl.sum(part * weight[:, None], 0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """Split-K partitions for a decode batch: enough programs for ~WAVES waves over the SMs, no
    more splits than context tiles, a power of two. Depends on host ints only (graph-safe).
    (~4 programs per SM was tried: batch 64 then took 2 splits, and the decode kernel got no
    faster while the reduce kernel added ~0.1 ms per step on an H200. The one-kernel attention
    alone, 192-token contexts, was faster with fewer splits at batch 16-32 (benchmarks/
    RESULTS.md run 19: b=32 12.5 us per layer at one split against 15.2 at the two chosen
    here), but not in the engine: with ~one wave (`WAVES` 1)
    decode went 3726.3 -> 3723.1 tok/s at batch 16 and 6550.3 -> 6572.6 at 32, run 20.)"""
    programs = num_seqs * num_kv_heads
    wanted = -(-WAVES * num_sms // programs)
    useful = -(-max_seq_len // DECODE_BLOCK_N)
    splits = max(1, min(wanted, useful, MAX_SPLITS))
    return triton.next_power_of_2(splits) if splits > 1 else 1


def _split_k(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
             scale: float, block_q: int) -> torch.Tensor:
    """Split-K attention of rows of up to `block_q` new tokens each (1: `_decode_kernel`, one
    token per sequence; more: `_rows_kernel`, token j of a row at position seq_len - query_len
    + j), then the reduce over splits per token and head."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    num_seqs = metadata.num_seqs
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_sms = backends.num_sms(query.device.index or 0) if query.is_cuda else 8
    splits = num_decode_splits(num_seqs, num_kv_heads, metadata.max_seq_len, num_sms)
    part = m = l = out  # placeholders when one split writes the output directly
    if splits > 1:
        part = torch.empty(num_tokens * num_q_heads * splits, head_dim, dtype=torch.float32,
                           device=query.device)
        m = torch.empty(num_tokens * num_q_heads * splits, dtype=torch.float32,
                        device=query.device)
        l = torch.empty_like(m)
    block_d = triton.next_power_of_2(head_dim)
    block_tables = metadata.block_tables
    shared = dict(NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
                  HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
                  BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=splits, PRECISION=precision(query),
                  num_warps=DECODE_LAUNCH[0], num_stages=DECODE_LAUNCH[1])
    grid = (num_seqs, num_kv_heads, splits)
    if block_q == 1:
        _decode_kernel[grid](
            query, kv_cache, block_tables, metadata.seq_lens, out, part, m, l, scale,
            query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0),
            out.stride(1), kv_cache[0].numel(),
            BLOCK_G=max(16, triton.next_power_of_2(group)), **shared)
    else:
        _rows_kernel[grid](
            query, kv_cache, block_tables, metadata.seq_lens, metadata.query_start_loc, out,
            part, m, l, scale, query.stride(0), query.stride(1), block_tables.stride(0),
            out.stride(0), out.stride(1), kv_cache[0].numel(),
            BLOCK_G=rows_block_g(group, block_q), BLOCK_Q=block_q, **shared)
    if splits > 1:
        _decode_reduce_kernel[(num_tokens, num_q_heads)](
            part, m, l, out, out.stride(0), out.stride(1), NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, num_warps=4)
    return out


def rows_block_g(group: int, block_q: int) -> int:
    """Query-head slots per token in a `_rows_kernel` tile: the group, padded to a power of
    two and so that the tile has >= 16 rows (tl.dot's minimum)."""
    return max(triton.next_power_of_2(group), 16 // block_q, 1)


def rows_block_q(metadata: AttentionMetadata, num_q_heads: int, num_kv_heads: int) -> int:
    """BLOCK_Q of `_rows_kernel` for a batch with longer queries than decode (0: the batch
    runs the prefill kernel: a row longer than ROWS_MAX_QUERY_LEN, or a tile past
    ROWS_MAX_TILE rows)."""
    if metadata.max_query_len > ROWS_MAX_QUERY_LEN:
        return 0
    block_q = triton.next_power_of_2(metadata.max_query_len)
    group = num_q_heads // num_kv_heads
    return block_q if block_q * rows_block_g(group, block_q) <= ROWS_MAX_TILE else 0


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                    out_ptr, scale, q_stride_t, q_stride_h, bt_stride, out_stride_t,
                    out_stride_h, v_offset, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - query_len                                    # position of query 0
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    q_pos = first_pos + rows                                           # [M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)      # [M, D]
    kv_head = head // GROUP
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    end = tl.minimum(seq_len, first_pos + (tile + 1) * BLOCK_M)        # last query pos + 1
    _, l, acc = attend_context(q, cache_ptr, table, 0, end, kv_head, d, d_ok, scale, v_offset,
                                q_pos, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION,
                                CAUSAL=True)
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _prefill(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
             scale: float) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    fp32 = query.dtype == torch.float32
    block_m, block_n = (32, 32) if fp32 or head_dim > 128 else (128, 64)
    block_m = min(block_m, max(16, triton.next_power_of_2(metadata.max_query_len)))
    grid = (triton.cdiv(metadata.max_query_len, block_m), metadata.num_seqs, num_q_heads)
    block_tables = metadata.block_tables
    _prefill_kernel[grid](
        query, kv_cache, block_tables, metadata.seq_lens, metadata.query_start_loc, out, scale,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        kv_cache[0].numel(), NUM_KV_HEADS=num_kv_heads, GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision(query),
        num_warps=8 if block_m >= 128 else 4, num_stages=2)
    return out


def precision(query: torch.Tensor) -> str:
    return "ieee" if query.dtype == torch.float32 else "tf32"


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def check_cache(kv_cache: torch.Tensor) -> None:
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous ([2, num_blocks, block_size, num_kv_heads, "
                         "head_dim]); the Triton kernels address it by slot.")


@triton.jit
def _token_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                  out_ptr, scale, num_seqs, q_stride_t, q_stride_h, bt_stride, out_stride_t,
                  out_stride_h, v_offset, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                  PRECISION: tl.constexpr):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    ends = tl.load(query_start_loc_ptr + 1 + tl.arange(0, BLOCK_S),
                   mask=tl.arange(0, BLOCK_S) < num_seqs, other=2147483647)
    seq = tl.sum((ends <= token).to(tl.int32), 0)           # the sequence holding this token
    if seq >= num_seqs:   # past the last sequence's tokens (a CUDA graph's padding)
        return
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    context = tl.load(seq_lens_ptr + seq) - (query_end - 1 - token)   # positions it sees
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    d_ok = d < HEAD_DIM
    mask = (g < GROUP)[:, None] & d_ok[None, :]
    row = token.to(tl.int64)
    q = tl.load(q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=mask,
                other=0.0)                                             # [G, D]
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    m, l, acc = attend_context(q, cache_ptr, table, 0, context, kv_head, d, d_ok, scale,
                                v_offset, context, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                                PRECISION, CAUSAL=False)
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _every_token(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                 scale: float) -> torch.Tensor:
    """`_token_kernel` over every new token of the batch (the batch-invariant form)."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    block_tables = metadata.block_tables
    _token_kernel[(num_tokens, num_kv_heads)](
        query, kv_cache, block_tables, metadata.seq_lens, metadata.query_start_loc, out, scale,
        metadata.num_seqs, query.stride(0), query.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), kv_cache[0].numel(), NUM_KV_HEADS=num_kv_heads,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, BLOCK_S=triton.next_power_of_2(max(metadata.num_seqs, 1)),
        PRECISION=precision(query), num_warps=DECODE_LAUNCH[0], num_stages=DECODE_LAUNCH[1])
    return out


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, *, every_token: bool = False) -> torch.Tensor:
    """`kernels.paged_attention.paged_attention`'s contract (shapes there).

    Decode-only batches run the split-K decode kernel; batches of rows of at most
    ROWS_MAX_QUERY_LEN new tokens (speculative verify rows) its multi-token form
    (`_rows_kernel`); any other batch the varlen prefill kernel (decode rows included).
    Tolerances vs the float32 reference: bf16 ~1e-2 relative (P rounded to bf16), float32
    ~1e-5.

    Args:
        query: [num_tokens, num_q_heads, head_dim], bf16 / fp16 / fp32, unit stride on head_dim.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype.
        metadata: seq_lens [num_seqs] int32, block_tables [num_seqs, max_blocks] int32,
            query_start_loc [num_seqs + 1] int32 (prefill), max_seq_len / max_query_len (host).
    Returns:
        [num_tokens, num_q_heads, head_dim], query's dtype.
    """
    check_cache(kv_cache)
    query = _unit_last_stride(query)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if every_token:
        return _every_token(query, kv_cache, metadata, scale)
    if metadata.is_decode_only:
        return _split_k(query, kv_cache, metadata, scale, 1)
    block_q = rows_block_q(metadata, query.shape[1], kv_cache.shape[3])
    if block_q:
        return _split_k(query, kv_cache, metadata, scale, block_q)
    return _prefill(query, kv_cache, metadata, scale)


def kernel_available() -> bool:
    """True when a CUDA device is present (Triton itself imported with this module)."""
    return torch.cuda.is_available()
