"""MLA prefill in Triton, expanded form: varlen causal flash attention over per-head K/V that
are decompressed from the paged latent cache, prefix-cache hits included.

For a chunk of q_len new tokens of a sequence of seq_len positions (seq_len - q_len of them
cached earlier, possibly by another request: a prefix hit), `expand_context` gathers the
sequence's seq_len latents through its block table and up-projects them in one GEMM with
kv_b_proj's weight (`[c_KV] @ [W_UK ; W_UV]^T`: per head Dn key columns and Dv value columns);
the rotary key k_R is shared by all heads and stays un-expanded. `_mla_prefill_kernel` then runs
FlashAttention-2's loop (Dao 2023) per (query tile, sequence, head): query j of the chunk sits
at position seq_len - q_len + j and sees positions <= its own; the score is q_nope . k_nope +
q_pe . k_R, two dots into one accumulator (Dn + R = 192 is not a power of two). Tiles of
BLOCK_M x BLOCK_N scores only: no [tokens, tokens] matrix.

Why expanded, not absorbed, for prefill: per (query, key) pair and head the absorbed form
multiplies over L + R + L = 1088 values, the expanded over Dn + R + Dv = 320; the up-projection
costs seq_len * L * H * (Dn + Dv) MACs once. benchmarks/RESULTS.md has the 2k-token timing of
both and of torch SDPA (`KernelConfig.mla_prefill` picks).

Numerics: fp32 scores / softmax / accumulation; P cast to the value dtype for P @ V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.settings import DEFAULT, KernelConfig

LOG2E = 1.4426950408889634


@triton.jit
def _attend(q_nope, q_rope, kn_ptr, kp_ptr, v_ptr, k_start, head, kn_st, kn_sh, kp_st, v_st,
            v_sh, m, l, acc, q_pos, begin, stop, end, scale_log2, dn, r, dv,
            NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """Online-softmax update of (m, l, acc) over key positions [begin, stop) (< end); CAUSAL
    masks position > q_pos per row (a row that sees nothing keeps m = -inf)."""
    for start in range(begin, stop, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        kv_row = k_start + pos                                      # [N] int64
        k_nope = tl.load(kn_ptr + kv_row[:, None] * kn_st + head * kn_sh + dn[None, :],
                         mask=valid[:, None] & (dn < NOPE)[None, :], other=0.0)  # [N, Dn]
        k_rope = tl.load(kp_ptr + kv_row[:, None] * kp_st + r[None, :],
                         mask=valid[:, None] & (r < ROPE)[None, :], other=0.0)   # [N, R]
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=PRECISION) * scale_log2
        if CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = m_new
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_row[:, None] * v_st + head * v_sh + dv[None, :],
                    mask=valid[:, None] & (dv < VDIM)[None, :], other=0.0)      # [N, Dv]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _mla_prefill_kernel(qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, info_ptr, qsl_ptr, seq_lens_ptr,
                        out_ptr, scale_log2, qn_st, qn_sh, qp_st, qp_sh, kn_st, kn_sh, kp_st,
                        v_st, v_sh, out_st, out_sh,
                        NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr,
                        BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)   # the longest (last) tiles start first
    chunk = tl.program_id(1)
    head = tl.program_id(2)
    seq = tl.load(info_ptr + chunk * 2)
    k_start = tl.load(info_ptr + chunk * 2 + 1).to(tl.int64)   # first row of its expanded K/V
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = seq_len - q_len + rows                                  # [M]
    token = (q_start + rows).to(tl.int64)
    dn = tl.arange(0, BLOCK_DN)
    r = tl.arange(0, BLOCK_R)
    dv = tl.arange(0, BLOCK_DV)
    q_nope = tl.load(qn_ptr + token[:, None] * qn_st + head * qn_sh + dn[None, :],
                     mask=row_ok[:, None] & (dn < NOPE)[None, :], other=0.0)   # [M, Dn]
    q_rope = tl.load(qp_ptr + token[:, None] * qp_st + head * qp_sh + r[None, :],
                     mask=row_ok[:, None] & (r < ROPE)[None, :], other=0.0)    # [M, R]

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)   # last query pos + 1
    # positions before the tile's first query are seen by every row: no mask; then the
    # diagonal tiles with the causal mask
    free_end = (seq_len - q_len + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    m, l, acc = _attend(q_nope, q_rope, kn_ptr, kp_ptr, v_ptr, k_start, head, kn_st, kn_sh,
                        kp_st, v_st, v_sh, m, l, acc, q_pos, 0, free_end, end, scale_log2,
                        dn, r, dv, NOPE, ROPE, VDIM, BLOCK_N, PRECISION, CAUSAL=False)
    m, l, acc = _attend(q_nope, q_rope, kn_ptr, kp_ptr, v_ptr, k_start, head, kn_st, kn_sh,
                        kp_st, v_st, v_sh, m, l, acc, q_pos, free_end, end, end, scale_log2,
                        dn, r, dv, NOPE, ROPE, VDIM, BLOCK_N, PRECISION, CAUSAL=True)
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + token[:, None] * out_st + head * out_sh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < VDIM)[None, :])


def kv_b_weight(w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[H * (Dn + Dv), L]: kv_b_proj's weight (per head Dn W_UK rows then Dv W_UV rows), a view
    when w_uk / w_uv are the model's views of it (`MLAAttention.finish_loading`), else built."""
    num_heads, nope, lora = w_uk.shape
    v_dim = w_uv.shape[1]
    per_head = (nope + v_dim) * lora
    if (w_uk.stride() == (per_head, lora, 1) and w_uv.stride() == (per_head, lora, 1)
            and w_uv.data_ptr() == w_uk.data_ptr() + nope * lora * w_uk.element_size()):
        return torch.as_strided(w_uk, (num_heads * (nope + v_dim), lora), (lora, 1))
    return torch.cat([w_uk, w_uv], dim=1).reshape(num_heads * (nope + v_dim), lora)


def expand_context(kv_cache: torch.Tensor, metadata: AttentionMetadata, chunks: list[int],
                   w_uk: torch.Tensor, w_uv: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head keys / values of the whole context of each sequence in `chunks`.

    Args:
        kv_cache: [num_blocks, block_size, L + R].
        chunks: indices of the prefill sequences (host ints).
    Returns:
        (kv [K, H, Dn + Dv] (W_UK c_KV then W_UV c_KV per head), k_rope [K, R] (a view of
        the gathered latents), info [len(chunks), 2] int32: (sequence, first row in kv)),
        K = the chunks' summed seq_lens.
    """
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    lora = w_uk.shape[2]
    device = kv_cache.device
    lengths = [metadata.seq_lens_cpu[c] for c in chunks]
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    info = torch.tensor([[c, s] for c, s in zip(chunks, starts)], dtype=torch.int32)
    slots = []
    for chunk, n in zip(chunks, lengths):   # device ops from host ints: no copy of positions
        pos = torch.arange(n, device=device)
        block_ids = metadata.block_tables[chunk, pos // block_size].to(torch.int64)
        slots.append(block_ids * block_size + pos % block_size)
    slots = slots[0] if len(slots) == 1 else torch.cat(slots)
    latents = kv_cache.view(-1, width).index_select(0, slots)
    kv = (latents[:, :lora] @ kv_b_weight(w_uk, w_uv).T).view(latents.shape[0], w_uk.shape[0], -1)
    return kv, latents[:, lora:], info.to(device, non_blocking=True)


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, chunks: list[int], w_uk: torch.Tensor,
                w_uv: torch.Tensor, scale: float, out: torch.Tensor,
                settings: KernelConfig = DEFAULT) -> None:
    """Expanded-form causal MLA for the sequences `chunks` of the batch, written into `out`.

    Args:
        q_nope: [num_tokens, H, Dn]; q_pe: [num_tokens, H, R] (rotated); unit last strides.
        kv_cache: [num_blocks, block_size, L + R], the latents of this step already written.
        metadata: the step's varlen batch; chunks: the sequence indices to run (host ints).
        w_uk: [H, Dn, L]; w_uv: [H, Dv, L].
        out: [num_tokens, H, Dv], q's dtype; the chunks' rows are written.
    """
    if not chunks:
        return
    kv, k_rope, info = expand_context(kv_cache, metadata, chunks, w_uk, w_uv)
    num_heads, nope = w_uk.shape[0], w_uk.shape[1]
    v_dim, rope = w_uv.shape[1], q_pe.shape[2]
    k_nope, value = kv[..., :nope], kv[..., nope:]
    max_q = max(metadata.query_lens_cpu[c] for c in chunks)
    fp32 = q_nope.dtype == torch.float32
    block_m = 32 if fp32 else settings.mla_prefill_block_m
    block_n = 32 if fp32 else settings.mla_prefill_block_n
    block_m = min(block_m, max(16, triton.next_power_of_2(max_q)))
    warps = 8 if block_m >= 128 else 4
    stages = 2
    grid = (triton.cdiv(max_q, block_m), len(chunks), num_heads)
    _mla_prefill_kernel[grid](
        q_nope, q_pe, k_nope, k_rope, value, info, metadata.query_start_loc, metadata.seq_lens,
        out, scale * LOG2E, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_rope.stride(0), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1), NOPE=nope, ROPE=rope, VDIM=v_dim,
        BLOCK_DN=max(16, triton.next_power_of_2(nope)),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if fp32 else "tf32", num_warps=warps, num_stages=stages)
