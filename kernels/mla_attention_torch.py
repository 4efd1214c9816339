"""Paged Multi-head Latent Attention in batched torch ops: runs on any device (the CPU fast path).

Two forms of the same attention (DeepSeek-V2, arXiv 2405.04434 §2.1.2-2.1.3):
- decode (one new token per sequence), absorbed: W_UK is folded into the query,
  `q_latent_i = q_nope_i W_UK_i` ([kv_lora_rank]), so scores are taken directly against the
  cached latents `[c_KV ; k_R]` and the output stays in the latent space until W_UV is applied
  once per token. Per token and head this reads kv_lora_rank + qk_rope_head_dim values per
  context position, with all heads sharing one latent "KV head" (MQA-like).
- prefill chunks (several new tokens of one sequence), expanded: the context latents are
  up-projected to per-head K and V once and attended with SDPA, which is cheaper when the query
  is long.
- verify rows (1 + k tokens of one sequence, in a step that scores draft tokens), absorbed in
  one batch (`rows_absorbed`): per query token the absorbed form reads (L + R) x context values
  per head, the expanded one up-projects the whole context first (context x L x H x (Dn + Dv)
  multiply-adds per sequence, whatever the query length), so at a few query tokens the
  absorbed form does a fraction of the work, and one batch for all rows replaces a Python
  loop of SDPA calls per sequence (tiny DeepSeek on the 2-core CPU box, batch 16 with 5 drafts
  each: a verify step 6.5 -> 3.0 ms).

Latent cache layout (one layer): `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.attention_metadata import AttentionMetadata


def _flat_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, D] -> [num_slots, D] view (no copy)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the MLA kv_cache must be contiguous ([num_blocks, block_size, "
                         "latent_dim]); a strided view would make the write land in a copy.")
    return kv_cache.view(-1, kv_cache.shape[-1])


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's latent at its slot, in place (contract: the reference's)."""
    flat = _flat_cache(kv_cache)
    if flat.is_cuda and slot_mapping.numel():
        _write_latent_no_sync(latent, flat, slot_mapping)
        return
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        latent, slot_mapping = latent[keep], slot_mapping[keep]
    flat.index_copy_(0, slot_mapping, latent)


def _write_latent_no_sync(latent: torch.Tensor, flat: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """`write_latent` without reading anything back to the host (CUDA-graph safe): a row with
    slot -1 rewrites the first kept row's slot with that row's own latent (or, when no row is
    kept, slot 0 with its current contents), so every duplicate index carries identical data."""
    keep = slot_mapping >= 0
    first = keep.to(torch.int8).argmax().view(1)  # first kept row, 0 if none
    target = torch.where(keep, slot_mapping, slot_mapping.index_select(0, first).clamp(min=0))
    fallback = torch.where(keep.index_select(0, first)[:, None], latent.index_select(0, first),
                           flat.index_select(0, target))
    flat.index_copy_(0, target, torch.where(keep[:, None], latent, fallback))


def _gather_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                   num_blocks: int) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, latent_dim]: the first `num_blocks` blocks of each
    sequence's table, position p of sequence i at [i, p]."""
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    return kv_cache.index_select(0, block_ids).view(block_tables.shape[0], -1, kv_cache.shape[-1])


def decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token per sequence, attention in the latent space.

    Args:
        q_nope: [num_seqs, H, Dn]; q_pe: [num_seqs, H, R] (rotated).
        kv_cache: [num_blocks, block_size, L + R].
        block_tables: [num_seqs, max_num_blocks_per_seq] int32.
        seq_lens: [num_seqs] int32, each <= max_seq_len; the new token sits at seq_len - 1.
        w_uk: [H, Dn, L]; w_uv: [H, Dv, L].
    Returns:
        [num_seqs, H, Dv], q_nope's dtype.
    """
    num_seqs = q_nope.shape[0]
    block_size, kv_lora_rank = kv_cache.shape[1], w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [S, H, L]
    query = torch.cat([q_latent, q_pe], dim=-1)  # [S, H, L + R]
    num_blocks = -(-max_seq_len // block_size)
    latents = _gather_blocks(kv_cache, block_tables, num_blocks)  # [S, L_pad, L + R]
    # one eager sequence reads exactly its context; on CUDA max_seq_len may be a CUDA graph's
    # bound (max_model_len) above the real lengths, so the mask always applies there
    masked = num_seqs > 1 or q_nope.is_cuda
    if not masked:
        latents = latents[:, :max_seq_len]
    # All heads share the one latent "KV head": two batched GEMMs (plain bmm, not SDPA: the
    # latent's value width differs from its key width, and small bmm calls stay cheap on a
    # busy CPU).
    scores = torch.bmm(query, latents.transpose(1, 2)).mul_(scale)  # [S, H, L_pad]
    if masked:
        positions = torch.arange(latents.shape[1], device=q_nope.device)
        scores.masked_fill_((positions >= seq_lens[:, None])[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out_latent = torch.bmm(probs, latents[:, :, :kv_lora_rank])  # [S, H, L]
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


# rows of a draft step up to this many query tokens run absorbed (`rows_absorbed`): verify rows
# hold 1 + num_speculative_tokens (<= 16 in every configuration here); the expanded form's
# fixed up-projection pays only past ~100 query tokens at DeepSeek's shapes (module docstring)
ABSORBED_MAX_QUERY = 16


def rows_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                  w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of several new tokens (the last query_len positions of each sequence's context),
    attention in the latent space, all rows in one batch (padded to the longest row).

    Args:
        q_nope: [num_tokens, H, Dn]; q_pe: [num_tokens, H, R] (rotated); the rows' tokens in
            order, num_tokens = sum(query_lens).
        kv_cache: [num_blocks, block_size, L + R].
        block_tables: [num_rows, max_num_blocks_per_seq] int32.
        query_lens, seq_lens: per row, its new tokens (>= 1) and its context length (host
            ints); token j of row i sits at seq_lens[i] - query_lens[i] + j and sees the
            positions up to its own.
        w_uk: [H, Dn, L]; w_uv: [H, Dv, L].
    Returns:
        [num_tokens, H, Dv], q_nope's dtype.
    """
    num_rows, longest = len(query_lens), max(query_lens)
    num_heads, kv_lora_rank = q_nope.shape[1], w_uk.shape[2]
    device = q_nope.device
    # host-built indices: padded slot (i, j) reads token `tokens` and sees positions < `limits`
    # (a padding slot: token 0's query over position 0 alone; its output is dropped)
    tokens, limits, kept, start = [], [], [], 0
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        tokens += [start + j if j < query_len else 0 for j in range(longest)]
        limits += [seq_len - query_len + j + 1 if j < query_len else 1 for j in range(longest)]
        kept += range(row * longest, row * longest + query_len)
        start += query_len
    padded = len(kept) < num_rows * longest
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
    query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, L + R]
    if padded:
        query = query[torch.tensor(tokens, device=device)]
    query = query.reshape(num_rows, longest * num_heads, -1)
    num_blocks = -(-max(seq_lens) // kv_cache.shape[1])
    latents = _gather_blocks(kv_cache, block_tables, num_blocks)  # [rows, L_pad, L + R]
    scores = torch.bmm(query, latents.transpose(1, 2)).mul_(scale)  # [rows, longest*H, L_pad]
    hidden = (torch.arange(latents.shape[1], device=device)
              >= torch.tensor(limits, device=device)[:, None])  # [rows * longest, L_pad]
    scores.view(num_rows, longest, num_heads, -1).masked_fill_(
        hidden.view(num_rows, longest, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out_latent = torch.bmm(probs, latents[:, :, :kv_lora_rank])  # [rows, longest*H, L]
    out_latent = out_latent.view(num_rows * longest, num_heads, -1)
    if padded:
        out_latent = out_latent[torch.tensor(kept, device=device)]
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def prefill_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_len: int, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Several new tokens of one sequence (the last query_len positions of its context), with
    the context latents up-projected to per-head K and V.

    Args:
        q_nope: [query_len, H, Dn]; q_pe: [query_len, H, R].
        block_table: [max_num_blocks_per_seq] int32.
        w_uk: [H, Dn, L]; w_uv: [H, Dv, L].
    Returns:
        [query_len, H, Dv], q_nope's dtype.
    """
    query_len, num_heads, nope_dim = q_nope.shape
    kv_lora_rank = w_uk.shape[2]
    num_blocks = -(-seq_len // kv_cache.shape[1])
    latents = _gather_blocks(kv_cache, block_table[None], num_blocks)[0, :seq_len]
    c_kv, k_pe = latents[:, :kv_lora_rank], latents[:, kv_lora_rank:]
    k_nope = (c_kv @ w_uk.reshape(-1, kv_lora_rank).T).view(seq_len, num_heads, nope_dim)
    value = (c_kv @ w_uv.reshape(-1, kv_lora_rank).T).view(seq_len, num_heads, -1)
    key = torch.cat([k_nope, k_pe[:, None].expand(-1, num_heads, -1)], dim=-1)  # [T, H, Dn+R]
    query = torch.cat([q_nope, q_pe], dim=-1)  # [q_len, H, Dn + R]
    mask = None
    if query_len != seq_len:  # bottom-right causal: query j sits at seq_len - query_len + j
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q_nope.device)
        mask = torch.arange(seq_len, device=q_nope.device) <= q_pos[:, None]
    out = F.scaled_dot_product_attention(   # a batch axis: see paged_attention_torch
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale)  # [1, H, q_len, Dv]
    return out[0].transpose(0, 1)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal MLA for a varlen batch: decode rows absorbed in one batch, a draft step's verify
    rows (<= ABSORBED_MAX_QUERY tokens) absorbed in another, prefill chunks expanded one
    sequence at a time. Arguments and result as the reference's."""
    if metadata.is_decode_only:
        return decode_absorbed(q_nope, q_pe, kv_cache, metadata.block_tables, metadata.seq_lens,
                               metadata.max_seq_len, w_uk, w_uv, scale)
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    decode_seqs, decode_rows, start = [], [], 0
    short_seqs, short_rows = [], []   # a draft step's verify rows (`rows_absorbed`)
    for seq, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu,
                                                   metadata.seq_lens_cpu, strict=True)):
        if query_len == 1:
            decode_seqs.append(seq)
            decode_rows.append(start)
        elif metadata.has_draft_rows and 1 < query_len <= ABSORBED_MAX_QUERY:
            short_seqs.append(seq)
            short_rows.extend(range(start, start + query_len))
        elif query_len > 1:
            rows = slice(start, start + query_len)
            out[rows] = prefill_expanded(q_nope[rows], q_pe[rows], kv_cache,
                                         metadata.block_tables[seq], seq_len, w_uk, w_uv, scale)
        start += query_len
    if decode_seqs:
        seqs = torch.tensor(decode_seqs, device=q_nope.device)
        rows = torch.tensor(decode_rows, device=q_nope.device)
        max_seq_len = max(metadata.seq_lens_cpu[seq] for seq in decode_seqs)
        out[rows] = decode_absorbed(q_nope[rows], q_pe[rows], kv_cache,
                                    metadata.block_tables[seqs], metadata.seq_lens[seqs],
                                    max_seq_len, w_uk, w_uv, scale)
    if short_seqs:
        seqs = torch.tensor(short_seqs, device=q_nope.device)
        rows = torch.tensor(short_rows, device=q_nope.device)
        out[rows] = rows_absorbed(q_nope[rows], q_pe[rows], kv_cache, metadata.block_tables[seqs],
                                  [metadata.query_lens_cpu[seq] for seq in short_seqs],
                                  [metadata.seq_lens_cpu[seq] for seq in short_seqs],
                                  w_uk, w_uv, scale)
    return out
