"""The pre-norm residual decoder block shared by the model families (Llama, DeepSeek)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from deepinfer.kernels.attention_metadata import AttentionMetadata


class NormedRows(NamedTuple):
    """A block output that already went through the next RMSNorm (with the residual add): the
    MLP's last kernel applied it (`forward_norm`), so the next layer skips its input norm and
    the model its final norm. rows: [T, hidden_size], the normed hidden states."""

    rows: torch.Tensor


class PreNormDecoderLayer(nn.Module):
    """`h + attn(norm(h))`, then `+ mlp(norm(.))`, with each residual add fused into the next
    RMSNorm. Subclasses set `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`.

    A subclass whose model folds RMSNorm weights into the linears after them
    (`kernels.fused_linear`) sets `norms_folded` on its layers and implements
    `forward_folded(rope, pending, residual, kv_cache, attn_metadata[, next_norm]) -> (pending,
    residual)`, which `forward` then runs (`next_norm` only where the model passes one).

    An MLP with `forward_norm(hidden, residual, next_norm) -> (NormedRows | out, residual)`
    may apply the next RMSNorm itself (DeepSeek's MoE, in its combine kernel) when the model
    hands the layer `next_norm`.
    """

    norms_folded = False

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor | None,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, next_norm: nn.Module | None = None
                ) -> tuple[torch.Tensor | NormedRows | None, torch.Tensor]:
        """hidden, residual: [T, hidden_size] (residual None at the first layer); rope: the
        (cos, sin) of this step's positions. Returns (mlp output, residual stream): the next
        layer adds them in its first norm. When folded, hidden may be None or
        `kernels.fused_linear.AddedRows` (the stream already holds the previous output), and
        so may the returned one. `next_norm`: the RMSNorm after this layer (the next layer's
        input norm or the model's final one), or None: an MLP with `forward_norm` may apply
        it and return `NormedRows` (residual then holds the sum); hidden may be NormedRows
        too (this layer's input norm already applied)."""
        if self.norms_folded:
            if residual is None:           # the first layer: the embeddings are the stream
                hidden, residual = None, hidden
            extra = {} if next_norm is None else {"next_norm": next_norm}
            return self.forward_folded(rope, hidden, residual, kv_cache, attn_metadata, **extra)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        elif isinstance(hidden, NormedRows):
            hidden = hidden.rows
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if next_norm is not None and hasattr(self.mlp, "forward_norm"):
            return self.mlp.forward_norm(hidden, residual, next_norm)
        return self.mlp(hidden), residual
