"""A decode step's attention in one Triton kernel: rotary, KV write, split-K attention, reduce.

At decode, a Llama layer's attention is three small kernels on the unfused path: rotary of q and
k with the KV write (`elementwise_triton.apply_rotary_write_kv`), the split-K decode kernel and
its reduce (`paged_attention_triton`). At batch 1 each is a few microseconds of launch and
latency, not bytes (H200, Llama-3-8B: 1.8 + 4.2 + 2.2 us per layer, benchmarks/RESULTS.md run 12).
`_rotary_decode_kernel` does all of it in one launch:

- program (sequence, kv head, split) loads the group's G query heads from the fused q|k|v
  projection and rotates them in registers (the rounding steps of the rotary kernel);
- it attends to its slice of the cached context ("flash-decoding" split-K, Dao et al. 2023,
  https://pytorch.org/blog/flash-decoding/, with the online softmax of Milakov & Gimelshein
  2018) with `paged_attention_triton._decode_kernel`'s loop (`attend_context`);
- the program whose slice holds the new token (position seq_len - 1) rotates that token's k,
  writes k and v at `slot_mapping[seq]` (skipped for slot -1), and adds the token to its
  softmax from registers: the cache is not read back, so no other program waits on the write;
- with one split holding context the program writes the output; otherwise each split stores
  its float32 partial output, running max and sum, and counts itself in on a per-(sequence, kv
  head) arrival counter (`kernels.backends.arrival_counters`); the split that arrives last
  combines the partials in split order 0, 1, ... (deterministic, whichever split finishes
  last), writes the output and resets the counter. No reduce kernel.

On Hopper it is launched with programmatic dependent launch (`kernels/pdl.py`): it waits for
the qkv GEMM before its first load and releases the o GEMM's launch right away.

Numerics against the unfused kernels: q and the cached k are bitwise the same; the new token's
score is an fp32 sum of exact products instead of a tensor-core dot (same values, another
summation order), and its P is rounded to the cache dtype before P V as in the dot path. bf16
outputs agree to ~1e-2 relative with the float32 reference (tests/kernels/
test_rotary_decode_triton.py).

KV cache layout (one layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, contiguous;
index 0 = K, 1 = V; slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.backends import MAX_ARRIVAL_COUNTERS, arrival_counters, num_sms
from deepinfer.kernels.paged_attention_triton import (DECODE_BLOCK_N, DECODE_LAUNCH, attend_context,
                                                      check_cache, num_decode_splits, precision)
from deepinfer.kernels.settings import DEFAULT, KernelConfig


@triton.jit
def _rotate(x, x_partner, cos, sin):
    """x * cos + rotate_half(x) * sin for one head dim d: x_partner = x[(d + D/2) % D] and
    sin the signed sine (-sin, sin); rounded as `elementwise_triton._rotary_write_kv_kernel`."""
    dtype = x.dtype
    return ((x * cos).to(dtype).to(tl.float32)
            + x_partner.to(tl.float32) * sin.to(tl.float32)).to(dtype)


@triton.jit
def _rotary_decode_kernel(qkv_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, block_tables_ptr,
                          seq_lens_ptr, out_ptr, part_ptr, m_ptr, l_ptr, counter_ptr, scale,
                          qkv_stride, cos_stride, sin_stride, bt_stride, v_offset,
                          NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, PDL: tl.constexpr,
                          TRIGGER_AFTER_LOOP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # everything below reads the previous kernels' outputs or writes
    pdl.wait_and_release(PDL, not TRIGGER_AFTER_LOOP)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), 1)
    active = tl.cdiv(num_tiles, tiles_per_split)        # splits with context; 0 if seq_len 0
    if split >= tl.maximum(active, 1):                   # (split 0 writes a padding row's 0s)
        return
    begin = split * tiles_per_split * BLOCK_N
    end = tl.minimum(begin + tiles_per_split * BLOCK_N, seq_len)
    new_pos = seq_len - 1                                # the new token: in registers
    owns_new = (new_pos >= begin) & (new_pos < end)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    partner = (d + HEAD_DIM // 2) % HEAD_DIM             # rotate_half's source dim
    token = qkv_ptr + seq.to(tl.int64) * qkv_stride
    cos = tl.load(cos_ptr + seq * cos_stride + d, mask=d_ok, other=0.0)
    sin = tl.load(sin_ptr + seq * sin_stride + d, mask=d_ok, other=0.0)
    heads = kv_head * GROUP + g                                        # [G] query heads
    q_mask = g_ok[:, None] & d_ok[None, :]
    q_ptrs = token + heads[:, None] * HEAD_DIM
    q = _rotate(tl.load(q_ptrs + d[None, :], mask=q_mask, other=0.0),
                tl.load(q_ptrs + partner[None, :], mask=q_mask, other=0.0),
                cos[None, :], sin[None, :])                            # [G, D]
    # the new token's k (to rotate), v and slot: loaded now, used after the context loop
    at_new = new_pos + 0 * d                             # [D] (a block mask, not a scalar)
    new_mask = d_ok & (at_new >= begin) & (at_new < end)
    k_ptr = token + (NUM_Q_HEADS + kv_head) * HEAD_DIM
    k_new = tl.load(k_ptr + d, mask=new_mask, other=0.0)
    k_partner = tl.load(k_ptr + partner, mask=new_mask, other=0.0)
    v_new = tl.load(token + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + d,
                    mask=new_mask, other=0.0)
    slot = tl.load(slot_ptr + seq).to(tl.int64)

    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    cached_end = tl.minimum(end, new_pos)                # cached positions: [begin, cached_end)
    m, row_sum, acc = attend_context(q, cache_ptr, table, begin, cached_end, kv_head, d, d_ok,
                                      scale, v_offset, seq_len, NUM_KV_HEADS, HEAD_DIM,
                                      BLOCK_SIZE, BLOCK_N, PRECISION, CAUSAL=False)
    if TRIGGER_AFTER_LOOP:
        pdl.launch_dependents(PDL)
    if owns_new:
        k_new = _rotate(k_new, k_partner, cos, sin)                   # [D]
        if slot >= 0:
            dst = cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + d
            tl.store(dst, k_new, mask=d_ok)
            tl.store(dst + v_offset, v_new, mask=d_ok)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale   # [G]
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_new)
        p_new = tl.exp(s_new - m_new).to(v_new.dtype).to(tl.float32)
        row_sum = row_sum * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new

    out_ptrs = out_ptr + ((seq * NUM_Q_HEADS + heads) * HEAD_DIM)[:, None] + d[None, :]
    dtype = out_ptr.dtype.element_ty
    if active <= 1:
        tl.store(out_ptrs, (acc / tl.maximum(row_sum, 1e-30)[:, None]).to(dtype), mask=q_mask)
    else:
        first = (seq * NUM_Q_HEADS + heads) * NUM_SPLITS                # [G] split 0's row
        tl.store(part_ptr + (first + split)[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        tl.store(m_ptr + first + split, m, mask=g_ok)
        tl.store(l_ptr + first + split, row_sum, mask=g_ok)
        tl.debug_barrier()   # every thread's partial is written before the arrival is counted
        counter = counter_ptr + seq * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == active - 1:    # the last split: combine all, in split order
            m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
            for other in range(0, active):
                m_max = tl.maximum(m_max, tl.load(m_ptr + first + other, mask=g_ok,
                                                  other=0.0, cache_modifier=".cg"))
            total = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for other in range(0, active):
                weight = tl.exp(tl.load(m_ptr + first + other, mask=g_ok, other=0.0,
                                        cache_modifier=".cg") - m_max)          # [G]
                total += weight * tl.load(l_ptr + first + other, mask=g_ok, other=0.0,
                                          cache_modifier=".cg")
                part = tl.load(part_ptr + (first + other)[:, None] * HEAD_DIM + d[None, :],
                               mask=q_mask, other=0.0, cache_modifier=".cg")
                acc += part * weight[:, None]
            tl.store(out_ptrs, (acc / tl.maximum(total, 1e-30)[:, None]).to(dtype),
                     mask=q_mask)
            tl.atomic_xchg(counter, 0)


def rotary_decode_attention(qkv: torch.Tensor, num_q_heads: int, cos: torch.Tensor,
                            signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                            metadata: AttentionMetadata, scale: float, *,
                            settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """Rotate q and k of a decode batch's fused projection, write k and v into the paged cache
    and attend: `kernels.rotary.apply_rotary_write_kv` then `paged_attention`, in one kernel.

    Args:
        qkv: [num_seqs, (num_q_heads + 2 * num_kv_heads) * head_dim], row blocks q | k | v,
            kv_cache's dtype, unit stride on the last dim; row i is sequence i's new token.
        num_q_heads: query heads (a multiple of the cache's kv heads).
        cos, signed_sin: [num_seqs, 1, head_dim] from `RotaryEmbedding.forward`, qkv's dtype
            (unit stride on head_dim); signed_sin = (-sin, sin).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        metadata: a decode-only batch: seq_lens [num_seqs] int32 (with the new token; 0 for a
            padding row: it reads nothing, writes nothing and returns zeros), block_tables
            [num_seqs, max_blocks] int32, slot_mapping [num_seqs] int64 (-1: no KV write),
            max_seq_len (host int: sets the split count, so a graph captured at the largest
            length stays valid below it).
        scale: softmax scale.
        settings: the kernel choices (`KernelConfig`: PDL launch and release).
    Returns:
        [num_seqs, num_q_heads, head_dim], qkv's dtype.
    Raises:
        ValueError: a batch that is not decode-only, a non-contiguous cache, or more
            (sequence, kv head) pairs than arrival counters.
    """
    if not metadata.is_decode_only:
        raise ValueError("rotary_decode_attention takes decode-only batches (one new token "
                         "per sequence); run apply_rotary_write_kv + paged_attention instead")
    check_cache(kv_cache)
    num_seqs = qkv.shape[0]
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    if num_seqs * num_kv_heads > MAX_ARRIVAL_COUNTERS:
        raise ValueError(f"{num_seqs} sequences x {num_kv_heads} kv heads exceed the "
                         f"{MAX_ARRIVAL_COUNTERS} arrival counters; decode in smaller batches")
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_seqs == 0:
        return out
    sms = num_sms(qkv.device.index or 0) if qkv.is_cuda else 8
    splits = num_decode_splits(num_seqs, num_kv_heads, metadata.max_seq_len, sms)
    counters = arrival_counters(qkv.device)   # int32 even when unused (the kernel compiles
    part = m = sums = out                     # its split path); placeholders for one split
    if splits > 1:
        rows = num_seqs * num_q_heads * splits
        part = torch.empty(rows, head_dim, dtype=torch.float32, device=qkv.device)
        m = torch.empty(rows, dtype=torch.float32, device=qkv.device)
        sums = torch.empty_like(m)
    group = num_q_heads // num_kv_heads
    block_tables = metadata.block_tables
    pdl_options = pdl.launch_options(qkv.device, settings)
    _rotary_decode_kernel[(num_seqs, num_kv_heads, splits)](
        qkv, cos, signed_sin, kv_cache, metadata.slot_mapping, block_tables, metadata.seq_lens,
        out, part, m, sums, counters, scale, qkv.stride(0), cos.stride(0), signed_sin.stride(0),
        block_tables.stride(0), kv_cache[0].numel(), NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=splits, PRECISION=precision(qkv),
        PDL=bool(pdl_options), TRIGGER_AFTER_LOOP=pdl.release_after_loop("attention", settings=settings),
        num_warps=DECODE_LAUNCH[0], num_stages=DECODE_LAUNCH[1], **pdl_options)
    return out
