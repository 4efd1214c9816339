"""MLA decode through DeepSeek's FlashMLA library (https://github.com/deepseek-ai/FlashMLA)
where the user installed it: the "flash_mla" backend of `kernels.mla_attention`.

FlashMLA serves what its kernel covers: decode batches whose rows all have the same number
(<= `KernelConfig.mla_decode_max_query_len`) of new tokens, bf16 / fp16, 64-token cache blocks, a 512 + 64 latent. Every other batch (and the
latent write) goes to the "triton" backend. The library is never required: `library_available`
says whether `import flash_mla` works, and `backend="auto"` picks this backend only then.

Its call: `get_mla_metadata(seq_lens, s_q * H, 1)` plans the split-K work per SM, then
`flash_mla_with_kvcache(q [B, s_q, H, L + R], cache [blocks, 64, 1, L + R], block_table,
seq_lens, L, metadata, num_splits, softmax_scale=, causal=True)` returns (out [B, s_q, H, L],
lse); we fold W_UK before and W_UV after, as for the Triton kernel.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from deepinfer.kernels import mla_attention_triton as triton_backend
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.settings import DEFAULT, KernelConfig

FLASH_MLA_BLOCK_SIZE = 64
FLASH_MLA_LATENT = (512, 64)
write_latent = triton_backend.write_latent


@functools.cache
def library_available() -> bool:
    """True if the `flash_mla` package is importable here."""
    return importlib.util.find_spec("flash_mla") is not None


def covers(q_nope: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
           w_uk: torch.Tensor, settings: KernelConfig = DEFAULT) -> bool:
    """True if FlashMLA's kernel covers this batch (see the module docstring): rows of
    equal length, each at most `settings.mla_decode_max_query_len` new tokens."""
    lens = metadata.query_lens_cpu
    return (library_available() and q_nope.is_cuda and kv_cache.shape[1] == FLASH_MLA_BLOCK_SIZE
            and metadata.max_query_len <= settings.mla_decode_max_query_len
            and q_nope.dtype in (torch.bfloat16, torch.float16)
            and (w_uk.shape[2], kv_cache.shape[2] - w_uk.shape[2]) == FLASH_MLA_LATENT
            and bool(lens) and min(lens) == max(lens))


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  scale: float, settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`kernels.mla_attention.mla_attention`'s contract; FlashMLA where it `covers` the batch,
    the Triton backend otherwise."""
    if not covers(q_nope, kv_cache, metadata, w_uk, settings):
        return triton_backend.mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                                            settings=settings)
    flash_mla = importlib.import_module("flash_mla")
    num_tokens, num_heads = q_nope.shape[:2]
    num_seqs, q_len = metadata.num_seqs, metadata.query_lens_cpu[0]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)    # [T, H, L]
    query = torch.cat([q_latent, q_pe], dim=-1).view(num_seqs, q_len, num_heads, -1)
    plan, splits = flash_mla.get_mla_metadata(metadata.seq_lens, q_len * num_heads, 1)
    out_latent, _ = flash_mla.flash_mla_with_kvcache(
        query, kv_cache.unsqueeze(2), metadata.block_tables, metadata.seq_lens, w_uk.shape[2],
        plan, splits, softmax_scale=scale, causal=True)                   # [B, s_q, H, L]
    out_latent = out_latent.reshape(num_tokens, num_heads, -1)
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
