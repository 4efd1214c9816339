"""Fixtures for engine tests: a tiny random-weight Llama checkpoint on disk (HF format)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Llama (hidden 64, GQA 4:2) with the SmolLM2 tokenizer, saved by HF.

    initializer_range is large so logits are peaked: greedy choices have clear margins and
    comparisons are not at the mercy of float rounding.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = smollm2_tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
