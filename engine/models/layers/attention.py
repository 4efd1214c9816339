"""`PagedAttention`: write this step's K/V into a layer's paged cache, then attend over it."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.paged_attention import paged_attention, write_kv
from deepinfer.kernels.rotary import rotary_paged_attention
from deepinfer.kernels.settings import DEFAULT, KernelConfig


class PagedAttention(nn.Module):
    """Causal GQA attention of a varlen batch against one layer's paged KV cache.

    The layer owns no weights: projections and rotary embedding stay in the model's attention
    block; this layer holds the head geometry, the softmax scale and the kernel backend;
    `kernel_config`: the GPU kernel choices (`layers.set_kernel_config` sets the engine's).
    """

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float,
                 backend: str = "auto") -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}; GQA needs whole groups.")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """
        Args:
            query: [num_tokens, num_heads, head_dim] (strided views of a fused projection ok).
            key, value: [num_tokens, num_kv_heads, head_dim], kv_cache's dtype.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; written in place at
                attn_metadata.slot_mapping.
        Returns:
            [num_tokens, num_heads * head_dim], query's dtype.
        """
        write_kv(key, value, kv_cache, attn_metadata.slot_mapping, backend=self.backend)
        return self.attend(query, kv_cache, attn_metadata)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
               attn_metadata: AttentionMetadata) -> torch.Tensor:
        """`forward` for a step whose K/V are already in kv_cache (written by a fused kernel,
        e.g. `kernels.rotary.apply_rotary_write_kv`). query: [num_tokens, num_heads, head_dim]
        -> [num_tokens, num_heads * head_dim]."""
        out = paged_attention(query, kv_cache, attn_metadata, self.scale, backend=self.backend,
                              batch_invariant=self.kernel_config.batch_invariant)
        return out.reshape(query.shape[0], self.num_heads * self.head_dim)

    def rotary_attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """`forward` from the fused q|k|v projection: rotate q and k, write k and v, attend
        (`kernels.rotary.rotary_paged_attention`: one kernel for a decode batch on
        CUDA). qkv: [num_tokens, (num_heads + 2 num_kv_heads) * head_dim]; rope: (cos,
        signed_sin) from `RotaryEmbedding.forward` -> [num_tokens, num_heads * head_dim]."""
        out = rotary_paged_attention(qkv, self.num_heads, self.num_kv_heads, *rope, kv_cache,
                                     attn_metadata, self.scale, backend=self.backend,
                                     settings=self.kernel_config)
        return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, scale={self.scale:.4g}, backend={self.backend!r}")
