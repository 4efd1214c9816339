"""Reference Multi-head Latent Attention (MLA) over a paged latent cache: one token at a time, in
float32, in the expanded (per-head K/V) form that defines it. The test oracle.

MLA (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3, arXiv 2412.19437 §2.1.1) caches per token
only the compressed KV `c_KV = RMSNorm(W_DKV h)` ([kv_lora_rank]) and the shared rotary key
`k_R = RoPE(W_KR h)` ([qk_rope_head_dim]). Head i's key is `[W_UK_i c_KV ; k_R]` and its value
`W_UV_i c_KV`; the query is `[q_nope_i ; q_rope_i]`.

Latent cache layout (one layer): `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`;
token slot `s` lives in block `s // block_size` at offset `s % block_size`.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's latent vector at its slot, in place.

    Args:
        latent: [num_tokens, kv_lora_rank + qk_rope_head_dim], the cache's dtype.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
        slot_mapping: [num_tokens] int64; a slot of -1 means "do not write this token".
    """
    block_size = kv_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            block_id, offset = divmod(slot, block_size)
            kv_cache[block_id, offset] = latent[token]


def _gather_context(kv_cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """Latents of positions 0..seq_len-1 of one sequence: [seq_len, latent_dim]."""
    block_size = kv_cache.shape[1]
    return torch.stack([kv_cache[block_table[p // block_size], p % block_size]
                        for p in range(seq_len)])


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal MLA of each new token over its sequence's cached latents (call `write_latent` first).

    Query token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends to
    positions 0..that position, read through block_tables[i].

    Args:
        q_nope: [num_tokens, num_heads, qk_nope_head_dim].
        q_pe: [num_tokens, num_heads, qk_rope_head_dim], already rotated.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
        metadata: the varlen batch (query_start_loc, seq_lens, block_tables).
        w_uk: [num_heads, qk_nope_head_dim, kv_lora_rank] up-projection of the keys (W_UK).
        w_uv: [num_heads, v_head_dim, kv_lora_rank] up-projection of the values (W_UV).
        scale: softmax scale (qk_head_dim ** -0.5, times YaRN's mscale² where it applies).
    Returns:
        [num_tokens, num_heads, v_head_dim], q_nope's dtype. Computed in float32.
    """
    kv_lora_rank = w_uk.shape[2]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    starts = metadata.query_start_loc.tolist()
    block_tables = metadata.block_tables.tolist()
    w_uk, w_uv = w_uk.float(), w_uv.float()
    for seq, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        latents = _gather_context(kv_cache, block_tables[seq], seq_len).float()
        c_kv, k_pe = latents[:, :kv_lora_rank], latents[:, kv_lora_rank:]
        k_nope = torch.einsum("hdl,tl->thd", w_uk, c_kv)  # [seq_len, H, Dn]
        value = torch.einsum("hvl,tl->thv", w_uv, c_kv)  # [seq_len, H, Dv]
        for j in range(end - start):
            position = seq_len - (end - start) + j
            scores = (torch.einsum("hd,thd->ht", q_nope[start + j].float(), k_nope[:position + 1])
                      + torch.einsum("hr,tr->ht", q_pe[start + j].float(), k_pe[:position + 1]))
            probs = torch.softmax(scores * scale, dim=-1)  # [H, position + 1]
            out[start + j] = torch.einsum("ht,thv->hv", probs, value[:position + 1])
    return out
