"""The pre-norm residual decoder block shared by the model families (Llama, DeepSeek)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.attention_metadata import AttentionMetadata


class PreNormDecoderLayer(nn.Module):
    """`h + attn(norm(h))`, then `+ mlp(norm(.))`, with each residual add fused into the next
    RMSNorm. Subclasses set `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`.
    """

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: [T, hidden_size] (residual None at the first layer); rope: the
        (cos, sin) of this step's positions. Returns (mlp output, residual stream): the next
        layer adds them in its first norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
