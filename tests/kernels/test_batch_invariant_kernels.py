"""The CPU kernels of the batch-invariant mode (`KernelConfig.batch_invariant`): a row's bits
depend on that row alone, never on how many rows share the call or where it sits among them.
Each kernel is also checked against the float32 reference (summation order only)."""

import random

import numpy as np
import pytest
import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.linear import linear, pack_linear_weight, quantize_linear_weight
from deepinfer.kernels.paged_attention import paged_attention
from deepinfer.kernels.quantized_linear import cpu_kernel_available, quantized_linear
from deepinfer.kernels.settings import KernelConfig

CPU_ONLY = pytest.mark.skipif(not cpu_kernel_available(),
                                reason="the C++ CPU extension does not build here")

INVARIANT = KernelConfig(batch_invariant=True)
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 70)


def rows_alone_and_batched(f, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(each row of x through f by itself, f over the first M rows for each M in ROW_COUNTS
    and over the rows reversed, un-reversed)."""
    alone = torch.cat([f(x[i:i + 1]) for i in range(len(x))])
    batched = [f(x[:m]) for m in ROW_COUNTS] + [f(x.flip(0)).flip(0)]
    return alone, batched


def assert_row_invariant(f, x: torch.Tensor) -> torch.Tensor:
    alone, batched = rows_alone_and_batched(f, x)
    for out in batched:
        assert torch.equal(out, alone[:len(out)])
    return alone


def weight_of(qtype: str, shape, seed=0) -> torch.Tensor:
    """Float32 values of a random weight after llama.cpp's quantize + dequantize ("Q4_1",
    "Q8_0")."""
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, qtype)
    gguf_quants = gguf.quants
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    blocks = gguf_quants.quantize(weight.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(blocks, qtype)))


@CPU_ONLY
@pytest.mark.parametrize("shape", [(96, 576), (37, 100), (64, 64), (5, 8)])
def test_float32_linear_rows_do_not_depend_on_the_batch(shape):
    n, k = shape
    weight, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(70, k)
    out = assert_row_invariant(
        lambda rows: linear(rows, weight, bias, pack_linear_weight(weight), None,
                            settings=INVARIANT), x)
    torch.testing.assert_close(out, x @ weight.T + bias, atol=1e-4, rtol=1e-5)


@CPU_ONLY
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512-if-present", "avx2"])
def test_quantized_linear_rows_do_not_depend_on_the_batch(qtype, avx512):
    weight = weight_of(qtype, (96, 576))
    qweight = quantize_linear_weight(weight)
    from deepinfer.kernels.cpu_extension import cpu_extension

    ext = cpu_extension()
    if qweight.format == "q4_1":
        def f(rows):
            return ext.q4_1_linear(rows, qweight.codes, qweight.scales, qweight.mins,
                                   allow_avx512=avx512, row_invariant=True)
    else:
        def f(rows):
            return ext.q8_0_linear(rows, qweight.codes, qweight.scales, allow_avx512=avx512,
                                   row_invariant=True)
    x = torch.randn(70, 576)
    out = assert_row_invariant(f, x)
    torch.testing.assert_close(out, x @ weight.T, atol=1e-4, rtol=1e-5)
    # the dispatcher routes every row count there in the mode (prefill-sized inputs too)
    assert torch.equal(linear(x, weight, None, None, qweight, settings=INVARIANT),
                       quantized_linear(x, qweight, row_invariant=True))


def paged_context(seq_lens, block_size=4, num_kv_heads=2, head_dim=64, seed=0):
    """A noise-filled cache and shuffled block tables for sequences of `seq_lens` tokens."""
    rng = random.Random(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(blocks) + 2))
    rng.shuffle(ids)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.tensor([ids.pop() for _ in range(count)])
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, sum(blocks) + 2, block_size, num_kv_heads, head_dim, generator=gen)
    return cache, tables


def attend(query, cache, tables, rows, query_lens, seq_lens):
    """Attention of query tokens for sequences `rows` (indices into tables), the last
    query_lens[i] tokens of a context of seq_lens[i] positions each."""
    starts = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables[rows],
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return paged_attention(query, cache, metadata, 0.125, batch_invariant=True)


@CPU_ONLY
def test_attention_tokens_do_not_depend_on_chunking_or_the_batch():
    """A 40-token sequence's outputs as one prefill chunk equal those of any chunk split, of
    decode steps one token at a time, and of the same chunks batched with another sequence;
    and they match the float32 reference."""
    cache, tables = paged_context([40, 23])
    query = torch.randn(40, 8, 64)
    full = attend(query, cache, tables, [0], [40], [40])
    for end in (1, 13, 27, 39, 40):       # a chunk ending at `end`, starting at 9 or 0
        start = min(9, end - 1)
        part = attend(query[start:end], cache, tables, [0], [end - start], [end])
        assert torch.equal(part, full[start:end])
    other = torch.randn(5, 8, 64)
    both = attend(torch.cat([other, query[20:]]), cache, tables, [1, 0], [5, 20], [23, 40])
    assert torch.equal(both[5:], full[20:])
    steps = torch.cat([attend(query[t:t + 1], cache, tables, [0], [1], [t + 1])
                       for t in range(40)])
    assert torch.equal(steps, full)
    from deepinfer.kernels.reference.paged_attention import paged_attention as reference

    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 40], dtype=torch.int32),
        seq_lens=torch.tensor([40], dtype=torch.int32), block_tables=tables[[0]],
        slot_mapping=torch.full((40,), -1), max_query_len=40, max_seq_len=40,
        query_lens_cpu=[40], seq_lens_cpu=[40])
    torch.testing.assert_close(full, reference(query, cache, metadata, 0.125), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_linear_rows_do_not_depend_on_the_batch(dtype):
    """The Triton GEMM at its invariant config: rows of 1..300 (decode to prefill sizes)."""
    for n, k in ((4096, 1024), (24576, 512), (200, 100)):
        weight = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        x = torch.randn(300, k, device="cuda", dtype=dtype)
        def f(rows):
            return linear(rows, weight, None, settings=INVARIANT)
        alone = torch.cat([f(x[i:i + 1]) for i in range(0, 300, 37)])
        for m in (1, 2, 17, 64, 65, 129, 300):
            assert torch.equal(f(x[:m])[::37], alone[:len(range(0, m, 37))])
        torch.testing.assert_close(f(x).float(), x.float() @ weight.float().T, atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_attention_tokens_do_not_depend_on_chunking_or_the_batch():
    cache, tables = paged_context([300, 40], block_size=16, num_kv_heads=2, head_dim=128)
    cache, tables = cache.cuda().bfloat16(), tables.cuda()
    query = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)

    def attend_cuda(q, rows, query_lens, seq_lens):
        starts = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            block_tables=tables[rows], slot_mapping=torch.full(
                (sum(query_lens),), -1, dtype=torch.int64, device="cuda"),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
        return paged_attention(q, cache, metadata, 0.088, batch_invariant=True)

    full = attend_cuda(query, [0], [300], [300])
    assert torch.equal(attend_cuda(query[250:], [0], [50], [300]), full[250:])
    assert torch.equal(attend_cuda(query[299:], [0], [1], [300]), full[299:])
    other = torch.randn(7, 8, 128, device="cuda", dtype=torch.bfloat16)
    both = attend_cuda(torch.cat([other, query[100:]]), [1, 0], [7, 200], [40, 300])
    assert torch.equal(both[7:], full[100:])
    # padding tokens past the last sequence (a CUDA graph's) are skipped, not attended
    padded = attend_cuda(torch.cat([query[290:], other[:3]]), [0], [10], [300])
    assert torch.equal(padded[:10], full[290:])
