"""Tiny random-weight checkpoints saved in HF format, shared by engine and server tests."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(path: Path, tokenizer, seed: int = 0) -> Path:
    """A 2-layer random Llama (hidden 64, GQA 4:2) with `tokenizer`, saved by HF into `path`.

    initializer_range is large so logits are peaked: greedy choices have clear margins and
    comparisons are not at the mercy of float rounding. Another `seed` gives the same
    config.json with other weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
