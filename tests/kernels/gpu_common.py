"""Shared setup of the Triton kernel tests: where they run and random paged batches.

The tests run on CUDA when a GPU and Triton are present. With `TRITON_INTERPRET=1` (and Triton
installed) they run on CPU through Triton's interpreter, which checks the kernels' logic on a
machine without a GPU (slow: keep shapes small). Otherwise they are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNNABLE = HAS_TRITON and (torch.cuda.is_available() or INTERPRET)
requires_triton = pytest.mark.skipif(
    not RUNNABLE, reason="needs CUDA + triton (or TRITON_INTERPRET=1 with triton on CPU)")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (METHOD.md's measure); NaN anywhere gives inf."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def random_paged_batch(query_lens: list[int], context_lens: list[int], *, num_q_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                       seed: int, spare_blocks: int = 3):
    """A filled KV cache and a varlen batch over shuffled (non-contiguous) block tables.

    Args:
        query_lens: new tokens per sequence (1 = decode).
        context_lens: cached tokens before this step per sequence (seq_len = context + query).
    Returns:
        (query [T, Hq, D], kv_cache [2, N, B, Hkv, D] random everywhere, metadata) on DEVICE.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(ids[at:at + n])
        at += n
    width = max(blocks_per_seq)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (c, q) in enumerate(zip(context_lens, query_lens)) for p in range(c, c + q)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)
    return query.to(DEVICE), kv_cache.to(DEVICE), metadata
