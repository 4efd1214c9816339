"""Shared fixtures. `smollm2_dir`: the embedded SmolLM2 GGUF converted to an HF directory.

The conversion lands in the default cache (~/.cache/deepinfer), so it happens once per machine
and later sessions reuse it in milliseconds.
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF-format directory of SmolLM2-135M-Instruct (float32 safetensors, tokenizer, configs)."""
    from engine.loader import resolve_model_dir

    return resolve_model_dir(None, None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The SmolLM2 tokenizer (byte-level BPE with a chat template), from the converted dir."""
    from engine.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture
def torch_single_thread():
    """Run the test's torch ops on one thread (restored after). The intra-op pool of a 2-core
    CI box stalls badly when other processes hold a core; these tests measure values, not
    speed."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
