"""`FakeRunner`: just a model runner's KV tensors and its block read/write methods (no model),
for the KV transfer tests on CPU (test_kv_transfer.py) and CUDA (test_kv_transfer_gpu.py)."""

from __future__ import annotations

import torch

from deepinfer.engine.model_runner import ModelRunner


class FakeRunner:
    """KV tensors of `spec`'s shape for `num_blocks` blocks of `block_size` tokens, random
    (seeded) values in `dtype` on `device`, with `ModelRunner`'s own block methods."""

    kv_block_dim = ModelRunner.kv_block_dim
    read_kv_blocks = ModelRunner.read_kv_blocks
    start_read_kv_blocks = ModelRunner.start_read_kv_blocks
    _gather_kv_blocks = ModelRunner._gather_kv_blocks
    _device_index = ModelRunner._device_index
    write_kv_blocks = ModelRunner.write_kv_blocks

    def __init__(self, spec, num_blocks: int, dtype: torch.dtype, seed: int, *,
                 block_size: int, device: str = "cpu") -> None:
        self.kv_cache_spec, self.block_size = spec, block_size
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        self.kv_caches = [torch.randn(spec.kv_cache_shape(num_blocks, block_size),
                                      generator=generator).to(device=device, dtype=dtype)
                          for _ in range(spec.num_layers)]
