"""The LM head's logits, shared by the causal LM classes."""

from __future__ import annotations

import torch

from deepinfer.engine.models.layers.linear import Linear
from deepinfer.engine.sampler import greedy_argmax


class CausalLMLogits:
    """Mixin for a causal LM module with an `lm_head` (a `Linear` to the vocabulary)."""

    lm_head: torch.nn.Module

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32 (the model
        dtype with float32=False: the LM head's output unconverted, e.g. for a greedy argmax
        that needs no float32 copy)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def logits_and_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_rows, hidden_size] -> (logits [num_rows, vocab_size] in the model dtype,
        greedy ids [num_rows] int64: `greedy_argmax(logits)`). Where the LM head runs the
        Triton skinny GEMM the argmax is taken in its epilogue, with no pass over the logits."""
        if isinstance(self.lm_head, Linear):
            logits, greedy_ids = self.lm_head.forward_row_argmax(hidden)
            if greedy_ids is not None:
                return logits, greedy_ids
        else:
            logits = self.lm_head(hidden)
        return logits, greedy_argmax(logits)
