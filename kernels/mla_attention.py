"""Public Multi-head Latent Attention ops: `write_latent` and `mla_attention`, on a backend.

MLA (DeepSeek-V2, arXiv 2405.04434 §2.1) caches one latent vector per token,
`[c_KV ; k_R]` of kv_lora_rank + qk_rope_head_dim values, instead of per-head K and V.

Backends, imported lazily on first use:
- "reference": `kernels/reference/mla_attention.py`, token by token in float32, expanded form.
- "torch": `kernels/mla_attention_torch.py`, batched torch ops on any device: decode rows in the
  absorbed form (attention in the latent space), prefill chunks expanded to per-head K/V.
`backend="auto"` is "torch" everywhere; an accelerated backend (e.g. a FlashMLA-style Triton
kernel) registers in `_BACKENDS` with an `auto` rule.

Latent cache layout (one layer): `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`;
slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.backends import Backends

_BACKENDS = Backends("MLA attention", {
    "reference": "deepinfer.kernels.reference.mla_attention",
    "torch": "deepinfer.kernels.mla_attention_torch",
})
BACKENDS = _BACKENDS.names


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 backend: str = "auto") -> None:
    """Store this step's latent vectors in the paged cache, in place.

    Args:
        latent: [num_tokens, kv_lora_rank + qk_rope_head_dim], the cache's dtype: the
            normalised c_KV then the rotated k_R.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], contiguous.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset; -1 = skip the token.
        backend: "auto", "reference" or "torch".
    """
    _BACKENDS.get(backend, kv_cache.device).write_latent(latent, kv_cache, slot_mapping)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  scale: float, backend: str = "auto") -> torch.Tensor:
    """Causal MLA for a varlen batch mixing prefill chunks and decode tokens.

    Head i attends with query `[q_nope_i ; q_pe_i]` to keys `[W_UK_i c_KV ; k_R]` and values
    `W_UV_i c_KV` of its sequence's positions up to its own (call `write_latent` first).

    Args:
        q_nope: [num_tokens, num_heads, qk_nope_head_dim].
        q_pe: [num_tokens, num_heads, qk_rope_head_dim], rotated.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], q's dtype.
        metadata: query_start_loc, seq_lens, block_tables and their host-side copies.
        w_uk: [num_heads, qk_nope_head_dim, kv_lora_rank] (W_UK; strided views of kv_b_proj's
            weight are fine: the last two dims must be row-major).
        w_uv: [num_heads, v_head_dim, kv_lora_rank] (W_UV; likewise).
        scale: softmax scale.
        backend: "auto", "reference" or "torch".
    Returns:
        [num_tokens, num_heads, v_head_dim], q_nope's dtype.
    """
    return _BACKENDS.get(backend, q_nope.device).mla_attention(q_nope, q_pe, kv_cache, metadata,
                                                          w_uk, w_uv, scale)
