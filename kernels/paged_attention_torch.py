"""Paged attention and KV write in batched torch ops: the fast path on CPU (runs on any device).

Decode-only batches (every sequence has one new token, the common case in steady serving) do one
batched gather of all contexts (whole blocks through the block tables) and one SDPA call with a
length mask, so the cost per layer is a handful of ops whatever the number of sequences.
Sequences with several new tokens (prefill chunks, speculative verification) run one SDPA call
each: their compute dwarfs the Python loop. The gather copies each context once per layer; at
long contexts times many sequences that copy dominates, which a fused kernel reading the blocks in
place (a future backend) avoids.

KV cache layout (one layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.attention_metadata import AttentionMetadata


def _flat_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, block_size, H, D] -> [2, num_slots, H, D] view (no copy)."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous ([2, num_blocks, block_size, num_kv_heads, "
                         "head_dim]); a strided view would make the KV write land in a copy.")
    two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return kv_cache.view(two, num_blocks * block_size, num_kv_heads, head_dim)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V at its slot, in place (see the reference for the contract).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype; may be strided views.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        slot_mapping: [num_tokens] int64; a slot of -1 means "do not write this token".
    """
    flat = _flat_cache(kv_cache)
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                   num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the first `num_blocks` blocks of each sequence's table out of the cache (whole blocks
    move as contiguous rows, much cheaper than slot by slot).

    Args:
        kv_cache: [2, num_cache_blocks, block_size, H_kv, D].
        block_tables: [num_seqs, max_num_blocks_per_seq] int32.
    Returns:
        keys, values: each [num_seqs, num_blocks * block_size, H_kv, D]; position p of
        sequence i at [i, p].
    """
    num_seqs = block_tables.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_ids = block_tables[:, :num_blocks].reshape(-1)  # [S * num_blocks]
    shape = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    return (kv_cache[0].index_select(0, block_ids).view(shape),
            kv_cache[1].index_select(0, block_ids).view(shape))


def _decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """One new token per sequence, all sequences in one gather + one SDPA call.

    Args:
        query: [num_seqs, num_q_heads, head_dim].
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [num_seqs, max_num_blocks_per_seq] int32.
        seq_lens: [num_seqs] int32, each <= max_seq_len; the new token sits at seq_len - 1.
    Returns:
        [num_seqs, num_q_heads, head_dim], query's dtype.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_blocks = -(-max_seq_len // block_size)
    keys, values = _gather_blocks(kv_cache, block_tables, num_blocks)  # [S, L_pad, H_kv, D]
    if num_seqs == 1:  # one length: trim instead of masking
        keys, values, mask = keys[:, :max_seq_len], values[:, :max_seq_len], None
    else:
        positions = torch.arange(num_blocks * block_size, device=query.device)
        mask = (positions < seq_lens[:, None])[:, None, None, :]  # [S, 1, 1, L_pad] bool
    # The group's query heads become G query rows against their shared kv head: no K/V repeat.
    out = F.scaled_dot_product_attention(
        query.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2), values.transpose(1, 2),  # [S, H_kv, L, D] strided views
        attn_mask=mask, scale=scale)  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_q_heads, head_dim)


def _prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_len: int, scale: float) -> torch.Tensor:
    """Several new tokens of one sequence (the last query_len positions of its context).

    Args:
        query: [query_len, num_q_heads, head_dim].
        block_table: [max_num_blocks_per_seq] int32.
    Returns:
        [query_len, num_q_heads, head_dim], query's dtype.
    """
    query_len = query.shape[0]
    num_blocks = -(-seq_len // kv_cache.shape[2])
    keys, values = _gather_blocks(kv_cache, block_table[None], num_blocks)
    keys, values = keys[0, :seq_len], values[0, :seq_len]  # [seq_len, H_kv, D]
    mask = None
    if query_len != seq_len:  # bottom-right causal: query j sits at seq_len - query_len + j
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device) <= q_pos[:, None]  # [q_len, seq_len]
    # [1, H, L, D]: with a batch axis PyTorch's CPU flash kernel runs; 3-D inputs took its math
    # kernel, ~4x slower (SmolLM2-sized, 512 queries over 3,500 positions: 24 against 110 ms)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)  # [1, H_q, q, D]
    return out[0].transpose(0, 1)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of each new token over its sequence's paged context.

    Args:
        query: [num_tokens, num_q_heads, head_dim]; num_q_heads a multiple of num_kv_heads.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype, already
            holding this step's K/V.
        metadata: the varlen batch; host-side lists drive the dispatch (no device sync).
        scale: softmax scale.
    Returns:
        [num_tokens, num_q_heads, head_dim], query's dtype.
    """
    if metadata.is_decode_only:
        return _decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                 metadata.max_seq_len, scale)
    out = torch.empty_like(query)
    decode_seqs, decode_rows, start = [], [], 0
    for seq, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu,
                                                   metadata.seq_lens_cpu)):
        if query_len == 1:
            decode_seqs.append(seq)
            decode_rows.append(start)
        elif query_len > 1:
            out[start:start + query_len] = _prefill_attention(
                query[start:start + query_len], kv_cache, metadata.block_tables[seq], seq_len,
                scale)
        start += query_len
    if decode_seqs:
        seqs = torch.tensor(decode_seqs, device=query.device)
        rows = torch.tensor(decode_rows, device=query.device)
        max_seq_len = max(metadata.seq_lens_cpu[seq] for seq in decode_seqs)
        out[rows] = _decode_attention(query[rows], kv_cache, metadata.block_tables[seqs],
                                      metadata.seq_lens[seqs], max_seq_len, scale)
    return out
