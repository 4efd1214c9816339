"""The C++ CPU ops (kernels/cpu_extension.py) against their torch references.

- `rms_norm` backend "cpu" vs the reference (`F.rms_norm`, plus `x.add_(residual)`): the normed
  output within 1e-6 relative (rtol 1e-6, atol 1e-6 * max|out|: fp32 sums in a different order),
  the residual sum exact (same fp32 add), written into x like the reference.
- Paged decode attention backend "cpu" vs `kernels/reference/paged_attention.py`: within atol
  1e-5 on O(1) random data (fp32 summation order), shuffled block tables, partial last blocks.
"""

import random

import pytest
import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.cpu_extension import cpu_extension
from deepinfer.kernels.paged_attention import paged_attention
from deepinfer.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.skipif(cpu_extension() is None,
                                reason="C++ CPU extension unavailable (no AVX2 or no compiler)")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


# ------------------------------------------------------------------ rms_norm


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 300])
@pytest.mark.parametrize("hidden", [576, 64, 37, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(num_tokens, hidden, with_residual, num_threads):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(num_tokens, hidden, generator=gen) if with_residual else None
    eps = 1e-5
    x_ref = x.clone()
    expected = rms_norm(x_ref, weight, eps, residual, backend="reference")
    got = rms_norm(x, weight, eps, residual, backend="cpu")
    if with_residual:
        (expected, expected_sum), (got, got_sum) = expected, got
        assert got_sum is x  # the sum overwrites x, as in the reference
        assert torch.equal(x, x_ref)
    else:
        assert torch.equal(x, x_ref)  # input untouched
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * scale)


def test_rms_norm_strided_rows():
    x = torch.randn(5, 128)[:, :64]  # row stride 128, unit stride along H
    weight = torch.randn(64)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6, backend="cpu"),
                               rms_norm(x.clone(), weight, 1e-6, backend="reference"),
                               rtol=1e-6, atol=1e-6)


def test_rms_norm_auto_keeps_other_dtypes_on_torch():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5),
                               rms_norm(x, weight, 1e-5, backend="reference"))


def test_rmsnorm_layer_uses_fused_op_with_same_semantics():
    from deepinfer.engine.models.layers.rms_norm import RMSNorm

    layer = RMSNorm(96, 1e-5, torch.float32)
    layer.weight.data.normal_()
    x, residual = torch.randn(3, 96), torch.randn(3, 96)
    expected_sum = x + residual
    normed, new_residual = layer(x, residual)
    assert new_residual is x and torch.equal(x, expected_sum)
    torch.testing.assert_close(normed, torch.rms_norm(expected_sum, (96,), layer.weight, 1e-5),
                               rtol=1e-6, atol=1e-6 * float(normed.abs().max()))


# ------------------------------------------------------------------ paged decode attention


def make_decode_batch(seq_lens, block_size, num_kv_heads, head_dim, seed):
    """Noise cache, shuffled block tables (one padding column), one query token per sequence.

    Returns (kv_cache [2, num_blocks, block_size, H_kv, D], metadata).
    """
    rng = random.Random(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    slots = []
    for seq, s_len in enumerate(seq_lens):
        table = [free.pop() for _ in range(blocks_per_seq[seq])]
        tables[seq, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots.append(table[(s_len - 1) // block_size] * block_size + (s_len - 1) % block_size)
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    num_seqs = len(seq_lens)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=1,
        max_seq_len=max(seq_lens), query_lens_cpu=[1] * num_seqs, seq_lens_cpu=list(seq_lens))
    return kv_cache, metadata


@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)], ids=["gqa9:3", "gqa8:2"])
def test_paged_decode_attention_matches_reference(batch, block_size, heads, num_threads):
    num_q_heads, num_kv_heads = heads
    head_dim = 64
    rng = random.Random(batch * 100 + block_size)
    seq_lens = [1, 700, block_size, block_size + 1][:batch]
    seq_lens += [rng.randint(1, 700) for _ in range(batch - len(seq_lens))]
    kv_cache, metadata = make_decode_batch(seq_lens, block_size, num_kv_heads, head_dim,
                                           seed=batch + block_size)
    gen = torch.Generator().manual_seed(7)
    # A strided view, as the model's q slice of the fused qkv projection is.
    qkv = torch.randn(batch, num_q_heads * head_dim + 5, generator=gen)
    query = qkv[:, :num_q_heads * head_dim].view(batch, num_q_heads, head_dim)
    scale = head_dim ** -0.5
    expected = paged_attention(query, kv_cache, metadata, scale, backend="reference")
    got = paged_attention(query, kv_cache, metadata, scale, backend="cpu")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_paged_decode_attention_verify_rows_match_per_token_decode_rows():
    """Rows of 1 + k tokens (`query_start_loc`): token j of a row of q tokens with context s is
    the decode query of its own over the first s - q + j + 1 positions; bitwise the same as
    those one-token calls. Rows that do not fit are refused, saying which."""
    ext = cpu_extension()
    if ext is None:
        pytest.skip("the CPU extension is unavailable here")
    kv_cache, metadata = make_decode_batch([40, 3, 70], 16, 3, 64, seed=5)
    starts = torch.tensor([0, 6, 9, 10], dtype=torch.int32)          # 6, 3 and 1 new tokens
    query = torch.randn(10, 9, 64, generator=torch.Generator().manual_seed(3))
    got = ext.paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                     0.125, query_start_loc=starts)
    seqs = [0] * 6 + [1] * 3 + [2]
    lens = [35, 36, 37, 38, 39, 40, 1, 2, 3, 70]
    per_token = ext.paged_decode_attention(query, kv_cache, metadata.block_tables[seqs],
                                           torch.tensor(lens, dtype=torch.int32), 0.125)
    assert torch.equal(got, per_token)
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0 to 10"):
        ext.paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                   0.125, query_start_loc=torch.tensor([0, 6, 9, 9],
                                                                       dtype=torch.int32))
    with pytest.raises(RuntimeError, match="sequence 1 has 4 new tokens but seq_len 3"):
        ext.paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                   0.125, query_start_loc=torch.tensor([0, 5, 9, 10],
                                                                       dtype=torch.int32))


@pytest.mark.parametrize("seq_len", [1, 2, 5, 63, 64, 65, 255, 700])
def test_paged_decode_attention_context_lengths(seq_len):
    kv_cache, metadata = make_decode_batch([seq_len], 16, 3, 64, seed=seq_len)
    query = torch.randn(1, 9, 64)
    expected = paged_attention(query, kv_cache, metadata, 0.125, backend="reference")
    got = paged_attention(query, kv_cache, metadata, 0.125, backend="cpu")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_auto_picks_cpu_kernel_for_float32_decode(monkeypatch):
    import deepinfer.kernels.paged_attention_cpu as cpu_backend

    calls = []
    ext = cpu_extension()
    real = ext.paged_decode_attention

    class Spy:
        def paged_decode_attention(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(cpu_backend, "_extension", lambda: Spy())
    kv_cache, metadata = make_decode_batch([5, 9], 4, 2, 16, seed=1)
    query = torch.randn(2, 4, 16)
    got = paged_attention(query, kv_cache, metadata, 0.25)
    assert calls == [torch.Size([2, 4, 16])]
    torch.testing.assert_close(got, paged_attention(query, kv_cache, metadata, 0.25,
                                                    backend="reference"), atol=1e-5, rtol=0)


def test_cpu_backend_hands_non_decode_and_bf16_batches_to_torch(monkeypatch):
    import dataclasses

    import deepinfer.kernels.paged_attention_cpu as cpu_backend

    calls = []

    class Spy:  # the C++ kernel must not be called for these batches
        def paged_decode_attention(self, *args):
            calls.append(args[0].shape)
            raise AssertionError("the C++ decode kernel took a batch it does not cover")

    monkeypatch.setattr(cpu_backend, "_extension", lambda: Spy())
    kv_cache, metadata = make_decode_batch([5, 9], 4, 2, 16, seed=2)
    query = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    got = paged_attention(query, kv_cache.bfloat16(), metadata, 0.25, backend="cpu")
    expected = paged_attention(query, kv_cache.bfloat16(), metadata, 0.25, backend="torch")
    torch.testing.assert_close(got, expected)
    # a prefill chunk: all 5 tokens of one sequence are queries
    kv_cache, decode = make_decode_batch([5], 4, 2, 16, seed=3)
    prefill = dataclasses.replace(
        decode, query_start_loc=torch.tensor([0, 5], dtype=torch.int32), max_query_len=5,
        query_lens_cpu=[5],
        slot_mapping=torch.tensor([int(decode.block_tables[0, p // 4]) * 4 + p % 4
                                   for p in range(5)], dtype=torch.int64))
    query = torch.randn(5, 4, 16)
    got = paged_attention(query, kv_cache, prefill, 0.25, backend="cpu")
    torch.testing.assert_close(got, paged_attention(query, kv_cache, prefill, 0.25,
                                                    backend="reference"), atol=1e-5, rtol=0)
    assert calls == []
