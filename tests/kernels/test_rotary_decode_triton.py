"""The one-kernel decode attention (kernels/rotary_decode_triton.py) against the unfused path.

Unfused: `elementwise_triton.apply_rotary_write_kv` then the float32 reference attention over
the written cache. The fused kernel must leave the cache bitwise as the unfused write does
(rounding steps of the rotary kernel), attend within float32 1e-5 / bf16 2e-2 relative of the
reference, give bitwise-equal outputs launch after launch (last-arriving split reduce in split
order), leave the arrival counters at zero, and treat CUDA-graph padding rows (seq_len 0,
slot -1) as the decode kernel does: zeros, no write.
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (gpu_common.py).
"""

import pytest
import torch

from gpu_common import DEVICE, random_paged_batch, relative_error, requires_triton
from deepinfer.kernels.backends import arrival_counters
from deepinfer.kernels.reference import paged_attention as reference

pytestmark = [pytest.mark.gpu, requires_triton]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
CASES = {
    # name: (context_lens, Hq, Hkv, D, block_size, graph bound for max_seq_len or None)
    "gqa_two_splits": ([37, 5, 70], 8, 2, 32, 16, None),
    "many_seqs_one_split": ([20] * 40, 8, 4, 32, 16, None),
    "long_many_splits": ([700], 4, 1, 32, 16, None),
    "graph_bound_mostly_empty_splits": ([300, 70, 129, 0], 8, 2, 32, 16, 1024),
    "new_token_opens_a_tile": ([64, 127], 4, 2, 32, 8, 512),
    "head_dim_80": ([9, 40], 4, 2, 80, 16, 256),
}


def _inputs(context_lens, hq, hkv, d, block_size, dtype, seed):
    """(qkv [B, (Hq + 2 Hkv) D], cos, signed_sin [B, 1, D], kv_cache, metadata)."""
    _, kv_cache, metadata = random_paged_batch(
        [1] * len(context_lens), context_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        block_size=block_size, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = len(context_lens)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE)
    angles = torch.rand(batch, 1, d // 2, generator=gen) * 6.28
    cos = angles.cos().repeat(1, 1, 2).to(dtype).to(DEVICE)
    sin = angles.sin()
    signed_sin = torch.cat([-sin, sin], dim=-1).to(dtype).to(DEVICE)
    return qkv, cos, signed_sin, kv_cache, metadata


def _unfused(qkv, hq, hkv, cos, signed_sin, kv_cache, metadata, scale):
    """(attention output via the float32 reference, the cache after the unfused write)."""
    from dataclasses import replace

    from deepinfer.kernels import elementwise_triton

    cache = kv_cache.clone()
    query = elementwise_triton.apply_rotary_write_kv(qkv, hq, hkv, cos, signed_sin, cache,
                                                     metadata.slot_mapping)
    cpu = replace(metadata, query_start_loc=metadata.query_start_loc.cpu(),
                  seq_lens=metadata.seq_lens.cpu(), block_tables=metadata.block_tables.cpu(),
                  slot_mapping=metadata.slot_mapping.cpu())
    out = reference.paged_attention(query.float().cpu(), cache.float().cpu(), cpu, scale)
    return out, cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_decode_matches_rotary_write_then_attention(case, dtype):
    from deepinfer.kernels.rotary_decode_triton import rotary_decode_attention

    context_lens, hq, hkv, d, block_size, bound = CASES[case]
    qkv, cos, signed_sin, kv_cache, metadata = _inputs(context_lens, hq, hkv, d, block_size,
                                                       dtype, seed=len(case))
    scale = d ** -0.5
    expected, expected_cache = _unfused(qkv, hq, hkv, cos, signed_sin, kv_cache, metadata,
                                        scale)
    if bound is not None:
        metadata.max_seq_len = bound     # as a CUDA graph captures it: more splits
    out = rotary_decode_attention(qkv, hq, cos, signed_sin, kv_cache, metadata, scale)
    assert out.shape == (len(context_lens), hq, d) and out.dtype == dtype
    assert torch.equal(kv_cache, expected_cache)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    for _ in range(2):   # graph replays: the same bits, the counters back at zero
        again = rotary_decode_attention(qkv, hq, cos, signed_sin, kv_cache, metadata, scale)
        assert torch.equal(again, out)
    assert not arrival_counters(kv_cache.device).any()


def test_padding_rows_give_zeros_and_write_nothing():
    """CUDA-graph padding (seq_len 0, slot -1) beside a real row, many splits."""
    from deepinfer.kernels.rotary_decode_triton import rotary_decode_attention

    qkv, cos, signed_sin, kv_cache, metadata = _inputs([30, 5], 4, 2, 32, 16, torch.float32,
                                                       seed=3)
    expected, expected_cache = _unfused(qkv[:1], 4, 2, cos[:1], signed_sin[:1], kv_cache,
                                        _first_row(metadata), 32 ** -0.5)
    metadata.seq_lens[1] = 0
    metadata.slot_mapping[1] = -1
    metadata.max_seq_len = 512
    out = rotary_decode_attention(qkv, 4, cos, signed_sin, kv_cache, metadata, 32 ** -0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(kv_cache, expected_cache)          # row 1 wrote nothing
    assert relative_error(out[:1], expected) < 1e-5


def _first_row(metadata):
    from dataclasses import replace

    return replace(metadata, query_start_loc=metadata.query_start_loc[:2],
                   seq_lens=metadata.seq_lens[:1], block_tables=metadata.block_tables[:1],
                   slot_mapping=metadata.slot_mapping[:1], query_lens_cpu=[1],
                   seq_lens_cpu=metadata.seq_lens_cpu[:1])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "switched_off"])
def test_rotary_paged_attention_dispatches_decode_to_the_fused_kernel(monkeypatch, fused):
    """`kernels.rotary.rotary_paged_attention` on "triton" (the model's call): a decode batch
    goes to the one-kernel path unless `KernelConfig.fused_rotary_decode` is off; either way
    the cache and the output are the unfused ops'."""
    from deepinfer.kernels import rotary, rotary_decode_triton
    from deepinfer.kernels.settings import KernelConfig

    calls = []
    real = rotary_decode_triton.rotary_decode_attention
    monkeypatch.setattr(rotary_decode_triton, "rotary_decode_attention",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    qkv, cos, signed_sin, kv_cache, metadata = _inputs([12, 3], 4, 2, 32, 16, torch.float32,
                                                       seed=8)
    expected, expected_cache = _unfused(qkv, 4, 2, cos, signed_sin, kv_cache, metadata,
                                        32 ** -0.5)
    out = rotary.rotary_paged_attention(qkv, 4, 2, cos, signed_sin, kv_cache, metadata,
                                        32 ** -0.5, backend="triton",
                                        settings=KernelConfig(fused_rotary_decode=fused))
    assert calls == ([qkv.shape] if fused else [])
    assert torch.equal(kv_cache, expected_cache)
    assert relative_error(out, expected) < 1e-5
