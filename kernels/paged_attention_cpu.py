"""Paged attention on CPU with a C++ decode kernel: the fast path for CPU float32 serving.

Decode-only batches (every sequence has one new token) of float32 run
`kernels/csrc/paged_attention_cpu.cpp` (in the one CPU extension, kernels/cpu_extension.py): per
(sequence, kv head) task, K and V are read in place from the paged cache through the block table
(no gather copy), two-pass softmax in fp32, GQA by sharing each kv head across its query-head
group; tasks are spread over torch's intra-op threads. Batches of decode rows and steps of short
verify rows (speculative decoding, `metadata.has_draft_rows`: 1 + k new tokens per row, k <=
VERIFY_MAX_QUERY_LEN - 1; steps without drafts keep one route whatever their lengths) run the same
kernel with one task row per token: token j of a row of q new tokens and context length s is a
decode query over the row's first s - q + j + 1 positions (causal), same block table (the
kernel maps tokens to rows from `query_start_loc`: a step's layers build no per-token tables). Everything
else (prefill chunks, other dtypes or devices) and the KV write go to the batched torch backend,
`kernels/paged_attention_torch.py`.

KV cache layout (one layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
"""

from __future__ import annotations

import torch

from deepinfer.kernels import paged_attention_torch
from deepinfer.kernels.attention_metadata import AttentionMetadata

write_kv = paged_attention_torch.write_kv
# rows of up to this many new tokens run the decode kernel token by token (verify rows); longer
# ones (prefill chunks) the torch backend, whose one SDPA per row is then cheaper
VERIFY_MAX_QUERY_LEN = 16


def _extension():
    from deepinfer.kernels.cpu_extension import cpu_extension

    return cpu_extension()


def kernel_available() -> bool:
    """True if the C++ decode kernel works here (builds the CPU extension on the first call)."""
    return _extension() is not None


def _decode_kernel_applies(query: torch.Tensor, kv_cache: torch.Tensor,
                           metadata: AttentionMetadata, every_token: bool) -> bool:
    short_rows = every_token or metadata.is_decode_only or (
        metadata.has_draft_rows and metadata.max_query_len <= VERIFY_MAX_QUERY_LEN)
    return (short_rows and query.device.type == "cpu"
            and query.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous() and query.stride(-1) == 1)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, *, every_token: bool = False) -> torch.Tensor:
    """`kernels.paged_attention.paged_attention`'s contract (shapes there); CPU float32 batches
    of decode and verify rows run the C++ kernel (float32 summation order vs the reference:
    atol 1e-5), the rest the torch backend. every_token: every batch of CPU float32 runs the C++
    kernel token by token, prefill chunks included (the batch-invariant mode: a token's bits
    then depend on its own context only)."""
    if _decode_kernel_applies(query, kv_cache, metadata, every_token):
        ext = _extension()
        if ext is None:
            raise RuntimeError("paged attention backend 'cpu' is unavailable here (see the logged "
                               "warning); use backend='torch' or 'auto'.")
        block_tables, seq_lens = metadata.block_tables, metadata.seq_lens
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
            block_tables = block_tables.to(torch.int32).contiguous()
        if metadata.is_decode_only:
            return ext.paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale)
        starts = metadata.query_start_loc
        if starts.dtype != torch.int32 or not starts.is_contiguous():
            starts = starts.to(torch.int32).contiguous()
        return ext.paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale,
                                          query_start_loc=starts)
    return paged_attention_torch.paged_attention(query, kv_cache, metadata, scale)
