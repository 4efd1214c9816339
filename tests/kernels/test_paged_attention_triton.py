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
    # rows of 1 + k tokens (speculative verify): the split-K rows kernel
    "verify_rows": ([6, 1, 4, 6], [40, 7, 130, 0], 8, 2, 32, 16),
    "verify_row_long_context_splits": ([6], [700], 9, 3, 64, 16),
    "verify_rows_mha_block8": ([2, 3], [20, 9], 4, 4, 16, 8),
    "verify_rows_of_16": ([16, 2], [90, 33], 4, 2, 32, 16),
    "rows_past_the_tile_run_prefill": ([9, 1], [50, 5], 16, 2, 32, 16),
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


def test_rows_kernel_takes_short_rows_whose_tile_fits():
    """Which batches the split-K rows kernel takes (BLOCK_Q, 0: the prefill kernel)."""
    from types import SimpleNamespace

    block_q = _triton().rows_block_q
    assert block_q(SimpleNamespace(max_query_len=6), 9, 3) == 8      # SmolLM2, gamma 5
    assert block_q(SimpleNamespace(max_query_len=6), 32, 8) == 8     # Llama-3-8B
    assert block_q(SimpleNamespace(max_query_len=2), 4, 4) == 2      # 2 x 8 head slots
    assert block_q(SimpleNamespace(max_query_len=17), 8, 2) == 0     # a prefill chunk
    assert block_q(SimpleNamespace(max_query_len=9), 16, 2) == 0     # 16 x 8 rows: too many
    assert _triton().rows_block_g(3, 8) == 4 and _triton().rows_block_g(1, 2) == 8


def test_verify_rows_padded_as_in_a_graph_give_zeros_for_padding_and_skip_empty_rows():
    """A verify graph's layout: real rows, then one-token padding rows with seq_len 0, then
    empty rows (query length 0), split count from the captured bound. Real rows match the
    reference; padding rows come out zero."""
    query, kv_cache, metadata = random_paged_batch(
        [4, 3, 1, 1], [30, 12, 0, 0], num_q_heads=8, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float32, seed=5)
    from dataclasses import replace

    metadata.seq_lens[2:] = 0
    qsl = metadata.query_start_loc
    empty = torch.cat([qsl, qsl[-1:].repeat(3)])                    # + three empty rows
    table = metadata.block_tables
    padded = replace(metadata, query_start_loc=empty,
                     seq_lens=torch.cat([metadata.seq_lens, metadata.seq_lens.new_zeros(3)]),
                     block_tables=torch.cat([table, table.new_zeros(3, table.shape[1])]),
                     max_seq_len=512, max_query_len=6,
                     query_lens_cpu=metadata.query_lens_cpu + [0, 0, 0],
                     seq_lens_cpu=metadata.seq_lens_cpu[:2] + [0] * 5)
    out = _triton().paged_attention(query, kv_cache, padded, 32 ** -0.5)
    real = replace(metadata, query_start_loc=qsl[:3], seq_lens=metadata.seq_lens[:2],
                   block_tables=table[:2], max_query_len=4,
                   query_lens_cpu=metadata.query_lens_cpu[:2],
                   seq_lens_cpu=metadata.seq_lens_cpu[:2])
    ref = _reference(query[:7], kv_cache, real, 32 ** -0.5)
    assert relative_error(out[:7], ref) < TOLERANCE[torch.float32]
    assert torch.equal(out[7:].cpu(), torch.zeros_like(out[7:].cpu()))


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
