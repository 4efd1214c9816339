"""Tuned-config lookup (`kernels.backends.tuned_table`): by (device name, shape), with a stated
fallback. A device without a file, or a shape without an entry, gets None from the lookups, so
the linear runs on cuBLAS / unfused: never an error. Host logic only (a fake device name)."""

import dataclasses
import json

import pytest
import torch

from deepinfer.kernels import backends, blas_choice, fused_linear

pytest.importorskip("triton")   # linear_triton compiles nothing here, but imports it


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """CONFIG_DIR in tmp_path and a CUDA device named "Fake GPU"; the table cache cleared."""
    monkeypatch.setattr(backends, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    backends.tuned_table.cache_clear()
    yield tmp_path
    backends.tuned_table.cache_clear()


def _cuda_weight(out_features, in_features):
    """What the lookups read of a weight: its device, shape and dtype (no GPU needed)."""
    return type("Weight", (), {"device": torch.device("cuda", 0), "dtype": torch.bfloat16,
                               "shape": torch.Size([out_features, in_features])})()


def test_no_file_for_the_device_means_every_fallback(fake_gpu):
    from deepinfer.kernels import linear_triton

    assert linear_triton.tuned_config(1, _cuda_weight(4096, 4096)) is None
    assert blas_choice.preferred_library(8, _cuda_weight(4096, 4096)) is None
    assert backends.tuned_table(fused_linear.CONFIG_KIND, torch.device("cuda", 0),
                                fused_linear.fused_table) == {}


def test_a_shape_without_an_entry_falls_back_and_a_listed_one_is_found(fake_gpu):
    from deepinfer.kernels import linear_triton

    config = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    path = backends.device_config_path(linear_triton.CONFIG_KIND, "Fake GPU")
    path.write_text(json.dumps({"entries": [
        {"block_m": 16, "out_features": 6144, "in_features": 4096, "config": config,
         "triton_faster": True}]}))
    assert linear_triton.tuned_config(3, _cuda_weight(6144, 4096)) == config      # bucket 16
    assert linear_triton.tuned_config(40, _cuda_weight(6144, 4096)) is None       # bucket 64: none
    assert linear_triton.tuned_config(3, _cuda_weight(1000, 4096)) is None        # other shape


def test_moe_tiles_from_plain_dicts_and_checked():
    """`moe_tiles` given as dicts (a JSON file, a CLI) become `MoETile`s; tiles under 16 rows
    (tl.dot's minimum) are refused."""
    import pytest

    from deepinfer.kernels.settings import KernelConfig, MoETile

    config = KernelConfig(moe_tiles=[{"max_rows": 4, "block_m": 16, "block_n": 32,
                                      "down_block_n": 64, "block_k": 128}])
    assert config.moe_tiles == (MoETile(4, 16, 32, 64, 128),)
    hash(config)
    with pytest.raises(ValueError, match="moe_tiles"):
        KernelConfig(moe_tiles=(MoETile(4, 8, 32, 64, 128),))
    pair = KernelConfig(moe_pair_tile={"max_rows": 1, "block_m": 16, "block_n": 64,
                                       "down_block_n": 64, "block_k": 128, "swap_ab": True})
    assert pair.moe_pair_tile == MoETile(1, 16, 64, 64, 128, swap_ab=True)
    with pytest.raises(ValueError, match="moe_pair_tile"):
        KernelConfig(moe_pair_tile=MoETile(1, 16, 8, 64, 128))


def test_float32_experts_keep_the_pipeline_in_shared_memory():
    """The batch-1 pair tile (5 stages, tuned for bf16) needs 288 KiB of shared memory in float32
    (the parity tests' dtype: Hopper allows 227); float32 runs it with fewer stages, bf16 and the
    aligned tiles keep theirs."""
    pytest.importorskip("triton")
    from deepinfer.kernels.moe_triton import _SHARED_MEMORY_BYTES, _stages_that_fit
    from deepinfer.kernels.settings import MOE_PAIR_TILE, MOE_TILES

    stages = _stages_that_fit(MOE_PAIR_TILE, 4, 4)
    weight_and_input = (MOE_PAIR_TILE.block_m + 2 * MOE_PAIR_TILE.block_n) * MOE_PAIR_TILE.block_k
    assert stages == 3 and (stages - 1) * weight_and_input * 4 <= _SHARED_MEMORY_BYTES
    assert _stages_that_fit(MOE_PAIR_TILE, 2, 2) == MOE_PAIR_TILE.num_stages == 5
    assert all(_stages_that_fit(tile, 4, 4) == tile.num_stages for tile in MOE_TILES)
    # FP8 weights (1 byte) with bf16 activations: the FP8 path's 128-wide K tiles keep theirs
    fp8_tiles = [dataclasses.replace(t, block_k=128, block_n=min(t.block_n, 128))
                 for t in MOE_TILES]
    assert all(_stages_that_fit(tile, 2, 1) == tile.num_stages for tile in fp8_tiles)
