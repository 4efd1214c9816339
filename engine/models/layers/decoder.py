"""The pre-norm residual decoder block shared by the model families (Llama, DeepSeek)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.attention_metadata import AttentionMetadata


class PreNormDecoderLayer(nn.Module):
    """`h + attn(norm(h))`, then `+ mlp(norm(.))`, with each residual add fused into the next
    RMSNorm. Subclasses set `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`.

    A subclass whose model folds RMSNorm weights into the linears after them
    (`kernels.fused_linear`) sets `norms_folded` on its layers and implements
    `forward_folded(rope, pending, residual, kv_cache, attn_metadata) -> (pending, residual)`,
    which `forward` then runs.
    """

    norms_folded = False

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor | None,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        """hidden, residual: [T, hidden_size] (residual None at the first layer); rope: the
        (cos, sin) of this step's positions. Returns (mlp output, residual stream): the next
        layer adds them in its first norm. When folded, hidden may be None or
        `kernels.fused_linear.AddedRows` (the stream already holds the previous output), and
        so may the returned one."""
        if self.norms_folded:
            if residual is None:           # the first layer: the embeddings are the stream
                hidden, residual = None, hidden
            return self.forward_folded(rope, hidden, residual, kv_cache, attn_metadata)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
