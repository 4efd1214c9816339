"""Triton paged attention + KV write vs the float32 torch reference (kernels/reference).

Tolerances (relative error ||out - ref|| / ||ref||): float32 inputs 1e-5 (IEEE dots, only the
summation order differs); bfloat16 2e-2 (P rounded to bf16 before P @ V, bf16 output).
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (see gpu_common.py).
"""

import pytest
import torch

from deepinfer.kernels.reference import paged_attention as reference
from gpu_common import DEVICE, random_paged_batch, relative_error, requires_triton

pytestmark = [pytest.mark.gpu, requires_triton]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _triton():
    from deepinfer.kernels import paged_attention_triton

    return paged_attention_triton


def _reference(query, kv_cache, metadata, scale):
    out = reference.paged_attention(query.float().cpu(), kv_cache.float().cpu(),
                                    _on_cpu(metadata), scale)
    return out


def _on_cpu(metadata):
    from dataclasses import replace

    return replace(metadata, query_start_loc=metadata.query_start_loc.cpu(),
                   seq_lens=metadata.seq_lens.cpu(), block_tables=metadata.block_tables.cpu(),
                   slot_mapping=metadata.slot_mapping.cpu())


CASES = {
    # name: (query_lens, context_lens, Hq, Hkv, D, block_size)
    "decode_gqa": ([1, 1, 1], [37, 5, 70], 8, 2, 32, 16),
    "decode_long_splits": ([1], [700], 4, 1, 32, 16),
    "decode_mha_block8": ([1, 1], [20, 9], 4, 4, 16, 8),
    "prefill_fresh": ([40, 17], [0, 0], 4, 2, 32, 16),
    "prefill_with_prefix": ([20], [45], 4, 2, 32, 16),
    "mixed": ([1, 33, 1, 5], [30, 0, 3, 16], 8, 2, 32, 16),
    "head_dim_80": ([1, 12], [9, 4], 4, 2, 80, 16),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, dtype):
    query_lens, context_lens, hq, hkv, d, block_size = CASES[case]
    query, kv_cache, metadata = random_paged_batch(
        query_lens, context_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        block_size=block_size, dtype=dtype, seed=hash(case) % 1000)
    scale = d ** -0.5
    out = _triton().paged_attention(query, kv_cache, metadata, scale)
    ref = _reference(query, kv_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_decode_splits_follow_batch_and_context():
    splits = _triton().num_decode_splits
    assert splits(1, 8, 8192, 132) == 32          # one sequence: fill the SMs
    assert splits(1, 8, 100, 132) == 2            # ...but no more splits than 64-token tiles
    assert splits(64, 8, 8192, 132) == 1          # 512 programs already fill 132 SMs
    assert splits(4, 8, 8192, 132) == 16


def test_decode_padded_rows_give_zeros_and_write_nothing():
    """CUDA-graph padding: rows with seq_len 0 and slot -1 must neither fault nor write."""
    query, kv_cache, metadata = random_paged_batch(
        [1, 1], [10, 3], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, seed=3)
    metadata.seq_lens[1] = 0
    metadata.max_seq_len = 512  # as captured: the bound, not the batch's maximum (-> splits)
    before = kv_cache.clone()
    slots = torch.tensor([-1, -1], dtype=torch.int64, device=DEVICE)
    _triton().write_kv(query[:, :2], query[:, 2:], kv_cache, slots)
    assert torch.equal(kv_cache, before)
    out = _triton().paged_attention(query, kv_cache, metadata, 32 ** -0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    metadata.max_seq_len = 11
    ref = _reference(query[:1], kv_cache, _first_row(metadata), 32 ** -0.5)
    assert relative_error(out[:1], ref) < 1e-5


def _first_row(metadata):
    from dataclasses import replace

    return replace(metadata, query_start_loc=metadata.query_start_loc[:2],
                   seq_lens=metadata.seq_lens[:1], block_tables=metadata.block_tables[:1],
                   query_lens_cpu=[1], seq_lens_cpu=[11])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(2, 6, 4, 2, 16, generator=gen).to(dtype).to(DEVICE)
    fused = torch.randn(5, 6, 16, generator=gen).to(dtype).to(DEVICE)  # [T, Hq+2Hkv, D]
    key, value = fused[:, 2:4], fused[:, 4:6]                          # strided views
    slots = torch.tensor([7, 0, -1, 23, 12], dtype=torch.int64, device=DEVICE)
    expected = kv_cache.clone().cpu()
    reference.write_kv(key.cpu(), value.cpu(), expected, slots.cpu())
    _triton().write_kv(key, value, kv_cache, slots)
    assert torch.equal(kv_cache.cpu(), expected)


def test_split_decode_is_repeatable_launch_after_launch():
    """Split-K decode with mostly empty splits (a graph's max_seq_len bound): repeated
    launches, as CUDA-graph replays are, give identical outputs, equal to the reference."""
    query, kv_cache, metadata = random_paged_batch(
        [1, 1, 1], [300, 70, 129], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, seed=11)
    metadata.max_seq_len = 1024   # as a graph captures it: 16 splits, most of them empty here
    first = _triton().paged_attention(query, kv_cache, metadata, 32 ** -0.5)
    for _ in range(3):
        assert torch.equal(_triton().paged_attention(query, kv_cache, metadata, 32 ** -0.5),
                           first)
    ref = _reference(query, kv_cache, metadata, 32 ** -0.5)
    assert relative_error(first, ref) < 1e-5
