"""Fixtures for engine tests: tiny random-weight Llama and DeepSeek-V3 checkpoints on disk (HF
format)."""

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Llama (hidden 64, GQA 4:2) with the SmolLM2 tokenizer, saved by HF.

    initializer_range is large so logits are peaked: greedy choices have clear margins and
    comparisons are not at the mercy of float rounding.
    """
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random DeepSeek-V3 (q_lora, noaux_tc routing, YaRN; no MTP layer) with the
    SmolLM2 tokenizer: the expert- and data-parallel tests' model."""
    from test_deepseek_parity import save_tiny_deepseek

    path = tmp_path_factory.mktemp("tiny-v3")
    save_tiny_deepseek(path, "v3_qlora_noaux_tc_yarn", vocab_size=len(smollm2_tokenizer),
                       bos_token_id=smollm2_tokenizer.bos_token_id,
                       eos_token_id=smollm2_tokenizer.eos_token_id, num_nextn_predict_layers=0)
    smollm2_tokenizer.save_pretrained(path)
    return path
