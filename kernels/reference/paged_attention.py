"""Reference paged attention and KV write: one token at a time, in float32. The test oracle.

KV cache layout (one layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 holds
K and index 1 holds V. Token slot `s` lives in block `s // block_size` at offset `s % block_size`.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V at its slot, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: [num_tokens] int64; a slot of -1 means "do not write this token".
    """
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        kv_cache[0, block_id, offset] = key[token]
        kv_cache[1, block_id, offset] = value[token]


def _gather_context(kv_cache: torch.Tensor, block_table: list[int],
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..seq_len-1 of one sequence: two [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    keys, values = [], []
    for position in range(seq_len):
        block_id = block_table[position // block_size]
        offset = position % block_size
        keys.append(kv_cache[0, block_id, offset])
        values.append(kv_cache[1, block_id, offset])
    return torch.stack(keys), torch.stack(values)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context.

    Query token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends to
    context positions 0..that position, read from the cache through block_tables[i]. The cache
    must already hold this step's K/V (write_kv runs first).

    Args:
        query: [num_tokens, num_q_heads, head_dim]; num_q_heads is a multiple of num_kv_heads.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype.
        metadata: the varlen batch (query_start_loc, seq_lens, block_tables).
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [num_tokens, num_q_heads, head_dim], query's dtype. Computed in float32.
    """
    num_q_heads = query.shape[1]
    group_size = num_q_heads // kv_cache.shape[3]  # query heads per kv head
    out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    block_tables = metadata.block_tables.tolist()
    for seq, seq_len in enumerate(seq_lens):
        start, end = starts[seq], starts[seq + 1]
        keys, values = _gather_context(kv_cache, block_tables[seq], seq_len)
        keys = keys.float().repeat_interleave(group_size, dim=1)  # [seq_len, num_q_heads, D]
        values = values.float().repeat_interleave(group_size, dim=1)
        for j in range(end - start):
            position = seq_len - (end - start) + j
            q = query[start + j].float()  # [num_q_heads, head_dim]
            scores = torch.einsum("hd,thd->ht", q, keys[: position + 1]) * scale
            probs = torch.softmax(scores, dim=-1)  # [num_q_heads, position + 1]
            out[start + j] = torch.einsum("ht,thd->hd", probs, values[: position + 1])
    return out
