"""Paged attention and KV write: every backend against the float32 reference.

Tolerances: float32 outputs within atol 2e-5 / rtol 1e-5 of the reference; bfloat16 within
atol 2e-2 (inputs are O(1), bf16 carries ~3 significant digits). KV writes are copies: exact.
"""

import dataclasses
import random

import pytest
import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.paged_attention import BACKENDS, paged_attention, write_kv

pytestmark = pytest.mark.usefixtures("torch_single_thread")
# CPU-tensor backends; "triton" (CUDA) has its own tests in test_paged_attention_triton.py
CPU_BACKENDS = [name for name in BACKENDS if name != "triton"]
FAST_BACKENDS = [name for name in CPU_BACKENDS if name != "reference"]


def make_batch(query_lens, seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """A cache full of noise, shuffled (non-contiguous) block tables and matching metadata.

    Returns (kv_cache [2, num_blocks, block_size, H_kv, D], metadata).
    """
    rng = random.Random(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay noise
    free = list(range(num_blocks))
    rng.shuffle(free)
    max_blocks = max(blocks_per_seq) + 1  # one padding column
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for seq, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        table = [free.pop() for _ in range(blocks_per_seq[seq])]
        tables[seq, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens))
    return kv_cache.to(dtype), metadata


CASES = {
    "decode_only": ([1, 1, 1, 1], [1, 17, 33, 64]),
    "single_decode": ([1], [37]),
    "prefill_only": ([5, 16, 23], [5, 16, 23]),
    "chunked_prefill": ([7, 3], [20, 35]),
    "mixed": ([1, 9, 1, 4, 1], [40, 9, 2, 19, 16]),
    "verify": ([6, 1, 3, 16], [40, 17, 3, 50]),   # speculative rows of 1 + k tokens
}


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64),
                                                               (8, 2, 16)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_reference(backend, case, num_q_heads, num_kv_heads, head_dim,
                                           block_size):
    query_lens, seq_lens = CASES[case]
    kv_cache, metadata = make_batch(query_lens, seq_lens, block_size, num_kv_heads, head_dim,
                                    torch.float32)
    if case == "verify":   # a step that scores drafts (the CPU backend's per-token route)
        metadata = dataclasses.replace(metadata, has_draft_rows=True)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim)
    scale = head_dim ** -0.5
    expected = paged_attention(query, kv_cache, metadata, scale, backend="reference")
    actual = paged_attention(query, kv_cache, metadata, scale, backend=backend)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_paged_attention_bfloat16(backend):
    kv_cache, metadata = make_batch([1, 6, 1], [30, 6, 3], 8, 2, 64, torch.bfloat16)
    query = torch.randn(8, 6, 64).to(torch.bfloat16)
    expected = paged_attention(query, kv_cache, metadata, 0.125, backend="reference")
    actual = paged_attention(query, kv_cache, metadata, 0.125, backend=backend)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_decode_ignores_context_past_seq_len():
    """Noise past a shorter sequence's length (its own last block, and the padding columns of
    its block table, which point at block 0) must not leak into its output."""
    kv_cache, metadata = make_batch([1, 1], [3, 50], 4, 2, 32, torch.float32)
    query = torch.randn(2, 4, 32)
    before = paged_attention(query, kv_cache, metadata, 0.2)
    own_block = metadata.block_tables[0, 0].item()
    assert own_block != 0  # the padding columns of sequence 0 point at another block
    kv_cache[:, own_block, 3] = 1e4  # position 3 of sequence 0: past its length
    kv_cache[:, 0] += 7.0
    torch.testing.assert_close(paged_attention(query, kv_cache, metadata, 0.2)[0], before[0])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_write_kv_places_tokens_and_skips_negative_slots(backend):
    kv_cache = torch.zeros(2, 5, 4, 2, 8)
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([13, -1, 0, 7], dtype=torch.int64)
    write_kv(key, value, kv_cache, slots, backend=backend)
    assert torch.equal(kv_cache[0, 3, 1], key[0]) and torch.equal(kv_cache[1, 3, 1], value[0])
    assert torch.equal(kv_cache[0, 0, 0], key[2]) and torch.equal(kv_cache[1, 1, 3], value[3])
    assert int((kv_cache != 0).any(-1).any(-1).sum()) == 2 * 3  # 3 tokens written, in K and V


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_write_kv_matches_reference_with_strided_inputs(backend):
    qkv = torch.randn(6, (4 + 2 + 2) * 16)  # fused projection output; k, v are strided views
    key = qkv[:, 64:96].view(6, 2, 16)
    value = qkv[:, 96:].view(6, 2, 16)
    slots = torch.tensor([3, 9, 10, 11, 30, 1], dtype=torch.int64)
    expected, actual = torch.zeros(2, 4, 8, 2, 16), torch.zeros(2, 4, 8, 2, 16)
    write_kv(key, value, expected, slots, backend="reference")
    write_kv(key, value, actual, slots, backend=backend)
    assert torch.equal(actual, expected)


def test_unknown_backend_is_refused():
    kv_cache, metadata = make_batch([1], [3], 4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="backend='cuda-magic' is unknown"):
        paged_attention(torch.randn(1, 1, 8), kv_cache, metadata, 1.0, backend="cuda-magic")


def test_strided_cache_is_refused():
    kv_cache = torch.zeros(2, 4, 8, 3, 16).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        write_kv(torch.zeros(1, 3, 16), torch.zeros(1, 3, 16), kv_cache,
                 torch.tensor([0]), backend="torch")
