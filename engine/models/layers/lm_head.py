"""The LM head's logits, shared by the causal LM classes."""

from __future__ import annotations

import torch


class CausalLMLogits:
    """Mixin for a causal LM module with an `lm_head` (a `Linear` to the vocabulary)."""

    lm_head: torch.nn.Module

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32 (the model
        dtype with float32=False: the LM head's output unconverted, e.g. for a greedy argmax
        that needs no float32 copy)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits
