"""Fixtures for engine tests: a tiny random-weight Llama checkpoint on disk (HF format)."""

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
