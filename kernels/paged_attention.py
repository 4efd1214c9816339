"""Public paged-attention ops: `write_kv` and `paged_attention`, dispatched to a backend.

Backends, imported lazily on first use:
- "reference": `kernels/reference/paged_attention.py`, token by token in float32 (the oracle).
- "torch": `kernels/paged_attention_torch.py`, batched torch ops; runs on any device.
- "cpu": `kernels/paged_attention_cpu.py`, a C++ kernel for CPU float32 decode-only batches
  reading K/V in place through the block tables; every other batch goes to "torch".
- "triton": `kernels/paged_attention_triton.py`, CUDA kernels reading the paged cache in place
  (split-K decode, varlen prefill, KV write that skips slot -1 without a host check).
Attention from a fused q|k|v projection, with rotary (one kernel for a decode batch on CUDA), is
`kernels.rotary.rotary_paged_attention`, built on these ops.

`backend="auto"` picks per device in `_auto_backend`: "cpu" on CPU where the C++ extension builds
(kernels/cpu_extension.py), "triton" on CUDA where Triton is installed, else "torch".

Batch-invariant mode (`batch_invariant=True`, from `KernelConfig.batch_invariant`): every query
token's result must not depend on the batch, on chunked-prefill boundaries or on prefix-cache
hits. On CPU every token then runs the C++ per-token kernel ("cpu": a fixed two-pass order over
its own context, prefill chunks included), or the float32 reference where the extension does
not build; on CUDA the Triton per-token kernel ("triton": `_token_kernel`, no split-K).

KV cache layout (one layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`; index 0 = K,
1 = V; slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.backends import Backends, triton_available


def _auto_backend(device: torch.device) -> str:
    """The backend "auto" means on `device`: the C++ kernel on CPU where it builds (it hands
    batches it does not cover to "torch"), "triton" on CUDA where Triton is installed, else
    the batched torch backend."""
    if device.type == "cpu" and _BACKENDS.load("cpu").kernel_available():
        return "cpu"
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"


_BACKENDS = Backends("paged attention", {
    "reference": "deepinfer.kernels.reference.paged_attention",
    "torch": "deepinfer.kernels.paged_attention_torch",
    "cpu": "deepinfer.kernels.paged_attention_cpu",
    "triton": "deepinfer.kernels.paged_attention_triton",
}, auto=_auto_backend)
BACKENDS = _BACKENDS.names
__all__ = ["BACKENDS", "paged_attention", "resolve_backend", "triton_available", "write_kv"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend name `backend` means on `device` ("auto" resolved, as `_auto_backend`).

    Raises:
        ValueError: `backend` is neither "auto" nor one of BACKENDS.
    """
    return _BACKENDS.resolve(backend, device)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str = "auto") -> None:
    """Store this step's K and V in the paged cache, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype (strided views ok).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset; -1 = skip the token.
        backend: "auto", "reference", "torch", "cpu" or "triton".
    """
    _BACKENDS.get(backend, kv_cache.device).write_kv(key, value, kv_cache, slot_mapping)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, backend: str = "auto", *,
                    batch_invariant: bool = False) -> torch.Tensor:
    """Causal attention for a varlen batch mixing prefill chunks and decode tokens (GQA ok).

    Query token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends to
    context positions 0..that position, read through block_tables[i]; call `write_kv` first.

    Args:
        query: [num_tokens, num_q_heads, head_dim]; num_q_heads a multiple of num_kv_heads.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype.
        metadata: query_start_loc [num_seqs + 1] int32, seq_lens [num_seqs] int32,
            block_tables [num_seqs, max_num_blocks_per_seq] int32, and their host-side copies.
        scale: softmax scale, usually head_dim ** -0.5.
        backend: "auto", "reference", "torch", "cpu" or "triton".
        batch_invariant: each token's bits independent of the rest of the batch (module
            docstring).

    Returns:
        [num_tokens, num_q_heads, head_dim], query's dtype.

    Raises:
        ValueError: batch_invariant on CUDA without Triton.
    """
    if batch_invariant:
        name = resolve_backend(backend, query.device)
        if name == "cpu":
            return _BACKENDS.load("cpu").paged_attention(query, kv_cache, metadata, scale,
                                                         every_token=True)
        if name == "triton":
            return _BACKENDS.load("triton").paged_attention(query, kv_cache, metadata, scale,
                                                            every_token=True)
        if query.device.type != "cpu":
            raise ValueError(f"batch-invariant paged attention has no form on backend {name!r} "
                             "(CUDA needs Triton); drop batch_invariant "
                             "(DEEPINFER_BATCH_INVARIANT) on this device.")
        return _BACKENDS.load("reference").paged_attention(query, kv_cache, metadata, scale)
    return _BACKENDS.get(backend, query.device).paged_attention(query, kv_cache, metadata, scale)
