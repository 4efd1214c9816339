"""Rotary position embedding applied to a varlen batch of heads: `apply_rotary`.

Backends: "reference" (`kernels/reference/rotary.py`, torch ops, any device) and "triton"
(`kernels/elementwise_triton.py`, one kernel on CUDA). `backend="auto"` takes "triton" for CUDA
tensors where Triton is installed, else "reference". Triton vs reference: bf16 within one ulp
(same rounding steps), float32 ~1e-6.

`apply_rotary_write_kv` rotates q and k of a fused q|k|v projection and stores k and v in the
paged KV cache (layout of `kernels/paged_attention.py`): one Triton kernel on CUDA; elsewhere
`apply_rotary` + `write_kv` (the reference, and the CPU path).

`rotary_paged_attention` is a layer's attention from its fused projection: `apply_rotary_write_kv`
then `kernels.paged_attention.paged_attention`, or on CUDA for a decode batch one kernel
(`kernels/rotary_decode_triton.py`).
"""

from __future__ import annotations

import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.backends import triton_available
from deepinfer.kernels.paged_attention import paged_attention, resolve_backend, write_kv
from deepinfer.kernels.settings import DEFAULT, KernelConfig

BACKENDS = ("reference", "triton")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 backend: str = "auto") -> torch.Tensor:
    """Rotate each head of `x`: x * cos + rotate_half(x) * sin.

    Args:
        x: [num_tokens, num_heads, head_dim] (strided views ok; unit stride on head_dim).
        cos, signed_sin: [num_tokens, 1, head_dim] in x's dtype; signed_sin = (-sin, sin).
        backend: "auto", "reference" or "triton".
    Returns:
        [num_tokens, num_heads, head_dim], a new contiguous tensor of x's dtype.
    """
    if backend == "auto":
        use_triton = x.is_cuda and x.stride(-1) == 1 and triton_available()
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        from deepinfer.kernels import elementwise_triton

        return elementwise_triton.apply_rotary(x, cos, signed_sin)
    if backend != "reference":
        raise ValueError(f"rotary backend={backend!r} is unknown; use 'auto' or one of "
                         f"{BACKENDS}.")
    from deepinfer.kernels.reference.rotary import apply_rotary as reference

    return reference(x, cos, signed_sin)


def apply_rotary_write_kv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                          cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Rotate q and k of a fused projection, write k and v into the paged cache, return q.

    Args:
        qkv: [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim], row blocks q | k | v,
            kv_cache's dtype, unit stride on the last dim.
        cos, signed_sin: [num_tokens, 1, head_dim] from `RotaryEmbedding.forward`.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous; the rotated
            k and v of token t land at slot_mapping[t] (K at index 0, V at 1).
        slot_mapping: [num_tokens] int64, block_id * block_size + offset; -1 = no write.
        backend: "auto", "reference" (apply_rotary + write_kv, each "auto") or "triton".
    Returns:
        query [num_tokens, num_q_heads, head_dim], rotated, qkv's dtype (a new tensor, or a
        view of one).
    """
    if backend == "auto":
        use_triton = qkv.is_cuda and qkv.stride(-1) == 1 and triton_available()
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        from deepinfer.kernels import elementwise_triton

        return elementwise_triton.apply_rotary_write_kv(qkv, num_q_heads, num_kv_heads, cos,
                                                        signed_sin, kv_cache, slot_mapping)
    if backend != "reference":
        raise ValueError(f"rotary backend={backend!r} is unknown; use 'auto' or one of "
                         f"{BACKENDS}.")
    num_tokens, head_dim = qkv.shape[0], kv_cache.shape[-1]
    qk_end = (num_q_heads + num_kv_heads) * head_dim
    # q and k are adjacent: rotate both in one pass -> [T, Hq + Hkv, D]
    qk = apply_rotary(qkv[:, :qk_end].view(num_tokens, -1, head_dim), cos, signed_sin)
    value = qkv[:, qk_end:].view(num_tokens, num_kv_heads, head_dim)
    write_kv(qk[:, num_q_heads:], value, kv_cache, slot_mapping)
    return qk[:, :num_q_heads]


def rotary_paged_attention(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                           cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                           metadata: AttentionMetadata, scale: float,
                           backend: str = "auto", *,
                           settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """A step's attention from its fused q|k|v projection: rotate q and k, store k and v at
    `metadata.slot_mapping`, attend (`apply_rotary_write_kv`, then
    `paged_attention`). On the "triton" backend a decode-only batch runs all of it in one
    kernel (`kernels/rotary_decode_triton.py`) unless `settings.fused_rotary_decode` is off.

    Args:
        qkv: [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim], row blocks q | k | v,
            kv_cache's dtype, unit stride on the last dim.
        num_q_heads, num_kv_heads: head counts (num_q_heads a multiple of num_kv_heads).
        cos, signed_sin: [num_tokens, 1, head_dim] from `RotaryEmbedding.forward`.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        metadata, scale, backend: as `paged_attention`.
        settings: the kernel choices (`KernelConfig`).
    Returns:
        [num_tokens, num_q_heads, head_dim], qkv's dtype.
    """
    name = resolve_backend(backend, qkv.device)
    if (name == "triton" and metadata.is_decode_only and settings.fused_rotary_decode
            and not settings.batch_invariant):
        from deepinfer.kernels.rotary_decode_triton import rotary_decode_attention

        return rotary_decode_attention(qkv, num_q_heads, cos, signed_sin, kv_cache, metadata,
                                       scale, settings=settings)
    query = apply_rotary_write_kv(qkv, num_q_heads, num_kv_heads, cos, signed_sin, kv_cache,
                                  metadata.slot_mapping,
                                  backend="triton" if name == "triton" else "auto")
    return paged_attention(query, kv_cache, metadata, scale, backend=name,
                           batch_invariant=settings.batch_invariant)
