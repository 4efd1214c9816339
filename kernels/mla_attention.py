"""Public Multi-head Latent Attention ops, on a backend: `write_latent`,
`rotate_and_write_latent`, `mla_attention`, and `rotate_write_and_attend` (the last two in one
call, fused where the backend can).

MLA (DeepSeek-V2, arXiv 2405.04434 §2.1) caches one latent vector per token,
`[c_KV ; k_R]` of kv_lora_rank + qk_rope_head_dim values, instead of per-head K and V.

Backends, imported lazily on first use:
- "reference": `kernels/reference/mla_attention.py`, token by token in float32, expanded form.
- "torch": `kernels/mla_attention_torch.py`, batched torch ops on any device: decode rows in the
  absorbed form (attention in the latent space), prefill chunks expanded to per-head K/V.
- "triton": `kernels/mla_attention_triton.py`, CUDA: a FlashMLA-style absorbed decode kernel
  (many heads per program, split-K + reduce, 1 + k token rows) and an expanded varlen flash
  prefill kernel over the paged cache; no host sync for decode-only batches (CUDA graphs).
- "flash_mla": `kernels/mla_attention_flashmla.py`, DeepSeek's FlashMLA library where the user
  installed it (decode-only batches on 64-token blocks; everything else goes to "triton").
`backend="auto"`: "flash_mla" on CUDA where `flash_mla` imports, else "triton" on CUDA where
Triton is installed, else "torch".

Latent cache layout (one layer): `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`;
slot = block_id * block_size + offset.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.backends import Backends, triton_available
from deepinfer.kernels.settings import DEFAULT, KernelConfig


def _auto_backend(device: torch.device) -> str:
    """"flash_mla" on CUDA where the library imports, "triton" on CUDA with Triton, else
    "torch"."""
    if device.type == "cuda" and triton_available():
        return "flash_mla" if _BACKENDS.load("flash_mla").library_available() else "triton"
    return "torch"


_BACKENDS = Backends("MLA attention", {
    "reference": "deepinfer.kernels.reference.mla_attention",
    "torch": "deepinfer.kernels.mla_attention_torch",
    "triton": "deepinfer.kernels.mla_attention_triton",
    "flash_mla": "deepinfer.kernels.mla_attention_flashmla",
}, auto=_auto_backend)
BACKENDS = _BACKENDS.names
_TAKES_SETTINGS = ("triton", "flash_mla")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend `backend` means on `device` ("auto" resolved); raises ValueError for an
    unknown name."""
    return _BACKENDS.resolve(backend, device)


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 backend: str = "auto") -> None:
    """Store this step's latent vectors in the paged cache, in place.

    Args:
        latent: [num_tokens, kv_lora_rank + qk_rope_head_dim], the cache's dtype: the
            normalised c_KV then the rotated k_R.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], contiguous.
        slot_mapping: [num_tokens] int64, block_id * block_size + offset; -1 = skip the token.
        backend: "auto" or one of BACKENDS ("flash_mla" writes with "triton").
    """
    _BACKENDS.get(backend, kv_cache.device).write_latent(latent, kv_cache, slot_mapping)


def rotate_and_write_latent(query: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                            kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            backend: str = "auto", settings: KernelConfig = DEFAULT
                            ) -> torch.Tensor:
    """MLA's step between the projections and the attention: rotate the queries' rope dims in
    place and store this step's latents `[RMSNorm(c_KV) ; RoPE(k_R)]` in the paged cache.

    Args:
        query: [num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim], unit last stride;
            its last qk_rope_head_dim dims are overwritten by their rotation.
        kv_a: [num_tokens, kv_lora_rank + qk_rope_head_dim] (kv_a_proj_with_mqa's output, unit
            last stride): c_KV then the unrotated k_R.
        norm_weight: [kv_lora_rank] (kv_a_layernorm's weight); eps: its epsilon.
        cos, signed_sin: [num_tokens, 1, qk_rope_head_dim] (`RotaryEmbedding.forward`).
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], contiguous.
        slot_mapping: [num_tokens] int64; -1 = do not store the token's latent.
        backend: "auto" or one of BACKENDS: "triton" / "flash_mla" run one Triton kernel, the
            others the torch ops (`kernels.rotary`, `kernels.rms_norm`, `write_latent`).
        settings: kernel choices (the Triton kernel's PDL launch; the RMSNorm of the torch ops).
    Returns:
        q_pe: [num_tokens, num_heads, qk_rope_head_dim], the rotated view of `query`.
    Numerics: the same rounding steps either way (bf16 within one ulp).
    """
    name = _BACKENDS.resolve(backend, query.device)
    if name in _TAKES_SETTINGS:
        return _BACKENDS.load("triton").rotate_and_write_latent(
            query, kv_a, norm_weight, eps, cos, signed_sin, kv_cache, slot_mapping,
            settings=settings)
    from deepinfer.kernels.rms_norm import rms_norm
    from deepinfer.kernels.rotary import apply_rotary

    rope_dim = cos.shape[-1]
    lora = kv_a.shape[-1] - rope_dim
    q_pe = query[..., query.shape[-1] - rope_dim:]
    q_pe.copy_(apply_rotary(q_pe, cos, signed_sin))
    c_kv = rms_norm(kv_a[:, :lora].contiguous(), norm_weight, eps, settings=settings)  # [T, L]
    k_pe = apply_rotary(kv_a[:, None, lora:], cos, signed_sin)[:, 0]  # [T, R]
    _BACKENDS.get(name, kv_cache.device).write_latent(torch.cat([c_kv, k_pe], dim=-1), kv_cache,
                                                      slot_mapping)
    return q_pe


def rotate_write_and_attend(query: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                            kv_cache: torch.Tensor, metadata: AttentionMetadata,
                            w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                            backend: str = "auto", settings: KernelConfig = DEFAULT
                            ) -> torch.Tensor:
    """MLA from the projections' outputs: `rotate_and_write_latent` (query's rope dims
    rotated in place, this step's latents stored at `metadata.slot_mapping`), then
    `mla_attention`; the "triton" backend folds the first into the W_UK absorption kernel of
    small decode batches (`KernelConfig.mla_rotate_in_absorb`). With
    `settings.batch_invariant`, every token runs the Triton absorbed decode path as a row of
    its own (`mla_attention_triton.every_token`).

    Raises:
        ValueError: batch_invariant off CUDA / without Triton.
    Args:
        query: [num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim], unit last stride.
        kv_a, norm_weight, eps, cos, signed_sin, kv_cache: as `rotate_and_write_latent`.
        metadata, w_uk, w_uv, scale, backend, settings: as `mla_attention`.
    Returns:
        [num_tokens, num_heads, v_head_dim], query's dtype.
    """
    name = _BACKENDS.resolve(backend, query.device)
    if settings.batch_invariant:
        if query.device.type != "cuda" or name not in ("triton", "flash_mla"):
            raise ValueError("batch-invariant MLA runs on CUDA with Triton only; drop "
                             "batch_invariant (DEEPINFER_BATCH_INVARIANT) for this model here.")
        return _BACKENDS.load("triton").every_token(
            query, kv_a, norm_weight, eps, cos, signed_sin, kv_cache, metadata, w_uk, w_uv,
            scale, settings=settings)
    if name == "triton":
        return _BACKENDS.load(name).rotate_write_and_attend(
            query, kv_a, norm_weight, eps, cos, signed_sin, kv_cache, metadata, w_uk, w_uv,
            scale, settings=settings)
    q_pe = rotate_and_write_latent(query, kv_a, norm_weight, eps, cos, signed_sin, kv_cache,
                                   metadata.slot_mapping, backend=name, settings=settings)
    return mla_attention(query[..., :query.shape[2] - cos.shape[-1]], q_pe, kv_cache, metadata,
                         w_uk, w_uv, scale, backend=name, settings=settings)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  scale: float, backend: str = "auto", settings: KernelConfig = DEFAULT
                  ) -> torch.Tensor:
    """Causal MLA for a varlen batch mixing prefill chunks and decode tokens.

    Head i attends with query `[q_nope_i ; q_pe_i]` to keys `[W_UK_i c_KV ; k_R]` and values
    `W_UV_i c_KV` of its sequence's positions up to its own (call `write_latent` first).

    Args:
        q_nope: [num_tokens, num_heads, qk_nope_head_dim].
        q_pe: [num_tokens, num_heads, qk_rope_head_dim], rotated.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], q's dtype.
        metadata: query_start_loc, seq_lens, block_tables and their host-side copies.
        w_uk: [num_heads, qk_nope_head_dim, kv_lora_rank] (W_UK; strided views of kv_b_proj's
            weight are fine: the last two dims must be row-major).
        w_uv: [num_heads, v_head_dim, kv_lora_rank] (W_UV; likewise).
        scale: softmax scale.
        backend: "auto" or one of BACKENDS.
        settings: the GPU kernels' tuning (tiles, splits; `KernelConfig.mla_*`).
    Returns:
        [num_tokens, num_heads, v_head_dim], q_nope's dtype.
    """
    name = _BACKENDS.resolve(backend, q_nope.device)
    extra = {"settings": settings} if name in _TAKES_SETTINGS else {}
    return _BACKENDS.load(name).mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv,
                                              scale, **extra)
