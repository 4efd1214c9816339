"""MLA attention and latent write on CUDA in Triton: the "triton" backend of
`kernels.mla_attention`.

- `write_latent`: one program per new token stores its latent at `slot_mapping[t]`, skipping
  slot -1 inside the kernel (no host check: safe in a CUDA graph).
- `rotate_and_write_latent`: one program per new token rotates its queries' rope dims in
  place, normalises c_KV, rotates k_R and stores the latent: one kernel where the torch ops
  take six (two rotaries, a copy, the norm, a concatenation, the write).
- `mla_attention`: rows of at most `KernelConfig.mla_decode_max_query_len` new tokens (decode,
  and 1 + k speculative rows) run absorbed in `kernels/mla_decode_triton.py`: W_UK folded into
  the query before (`absorb_query`, Triton, up to `KernelConfig.mla_absorb_triton_max_tokens`
  tokens; else one cuBLAS batched GEMM), W_UV applied in the split reduce (up to
  `mla_reduce_uv_max_tokens` tokens; else one batched GEMM after); longer chunks run expanded
  in `kernels/mla_prefill_triton.py`, except that by default (`KernelConfig.mla_prefill`
  "auto") chunks without a prefix-cache hit run torch SDPA on expanded K/V, which measured
  faster (`mla_attention_torch.prefill_expanded`). A decode-only batch
  reads only host ints from the metadata (`max_query_len`, `max_seq_len`, `num_seqs`): no
  device sync, static shapes, so it can be captured in a CUDA graph.

Tolerances vs the float32 reference: float32 ~1e-5; bf16 ~1e-2 relative (q_latent, P and the
latent output rounded to bf16, as the torch backend does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.mla_attention_torch import prefill_expanded
from deepinfer.kernels.mla_decode_triton import latent_attention
from deepinfer.kernels.mla_prefill_triton import mla_prefill
from deepinfer.kernels.settings import DEFAULT, KernelConfig


@triton.jit
def _write_latent_kernel(latent_ptr, cache_ptr, slot_ptr, latent_stride,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (cols < WIDTH) & ((slot + 0 * cols) >= 0)
    values = tl.load(latent_ptr + token * latent_stride + cols, mask=mask)
    tl.store(cache_ptr + slot * WIDTH + cols, values, mask=mask)


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's latent at its slot, in place (contract: kernels/mla_attention).

    Args:
        latent: [num_tokens, L + R], the cache's dtype, unit last stride.
        kv_cache: [num_blocks, block_size, L + R], contiguous.
        slot_mapping: [num_tokens] int64; -1 = skip the token.
    """
    if not kv_cache.is_contiguous():
        raise ValueError("the MLA kv_cache must be contiguous ([num_blocks, block_size, "
                         "latent_dim]); the Triton kernels address it by slot.")
    if latent.shape[0] == 0:
        return
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    width = kv_cache.shape[-1]
    _write_latent_kernel[(latent.shape[0],)](latent, kv_cache, slot_mapping, latent.stride(0),
                                             WIDTH=width, BLOCK=triton.next_power_of_2(width))


@triton.jit
def _rotate_halves(x1, x2, cos1, cos2, sin1, sin2, dtype: tl.constexpr):
    """(x1, x2) rotated as `kernels.reference.rotary`: addcmul(x * cos rounded to dtype,
    swapped, signed_sin) in float32, rounded once; sin1 is -sin."""
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + x2.to(tl.float32) * sin1.to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + x1.to(tl.float32) * sin2.to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _rotate_into(src, dst, load_ok, store_ok, cos_ptrs, sin_ptrs, HALF: tl.constexpr,
                 dtype: tl.constexpr):
    """Rotate the rope dims whose first halves `src` ([R, BLOCK_HALF] pointers) and second
    halves src + HALF address, storing them at dst and dst + HALF (dst may be src: in place);
    cos_ptrs / sin_ptrs: each row's cos and signed sin ([R, BLOCK_HALF] pointers to their
    first halves)."""
    x1, x2 = _rotate_halves(tl.load(src, mask=load_ok, other=0.0),
                            tl.load(src + HALF, mask=load_ok, other=0.0),
                            tl.load(cos_ptrs, mask=load_ok, other=0.0),
                            tl.load(cos_ptrs + HALF, mask=load_ok, other=0.0),
                            tl.load(sin_ptrs, mask=load_ok, other=0.0),        # -sin
                            tl.load(sin_ptrs + HALF, mask=load_ok, other=0.0), dtype)
    tl.store(dst, x1, mask=store_ok)
    tl.store(dst + HALF, x2, mask=store_ok)


@triton.jit
def _store_latents(kv_a_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, tokens, t_ok,
                   kv_a_stride, cos_stride, sin_stride, eps, LORA: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   dtype: tl.constexpr):
    """The latents of `tokens` ([R] int64, valid where t_ok): RMSNorm(c_KV) (as
    kernels/elementwise_triton.py's) times the norm weight, then the rotated k_R, stored at
    each token's slot (slot -1: not stored)."""
    slots = tl.load(slot_ptr + tokens, mask=t_ok, other=-1).to(tl.int64)        # [R]
    keep = (t_ok & (slots >= 0))[:, None]
    cols = tl.arange(0, BLOCK_L)[None, :]
    c_kv = tl.load(kv_a_ptr + tokens[:, None] * kv_a_stride + cols,
                   mask=t_ok[:, None] & (cols < LORA), other=0.0)               # [R, L]
    c_f = c_kv.to(tl.float32)
    normed = (c_f * tl.rsqrt(tl.sum(c_f * c_f, 1) / LORA + eps)[:, None]).to(dtype)
    weight = tl.load(norm_ptr + cols, mask=cols < LORA, other=0.0)
    rows = cache_ptr + slots[:, None] * (LORA + 2 * HALF)
    tl.store(rows + cols, normed * weight, mask=keep & (cols < LORA))
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = t_ok[:, None] & (dims < HALF)
    _rotate_into(kv_a_ptr + tokens[:, None] * kv_a_stride + LORA + dims, rows + LORA + dims,
                 d_ok, d_ok & keep, cos_ptr + tokens[:, None] * cos_stride + dims,
                 sin_ptr + tokens[:, None] * sin_stride + dims, HALF, dtype)


@triton.jit
def _rotate_write_latent_kernel(query_ptr, kv_a_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr,
                                slot_ptr, q_stride_t, q_stride_h, kv_a_stride, cos_stride,
                                sin_stride, num_heads, eps, NOPE: tl.constexpr,
                                LORA: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_HALF: tl.constexpr, BLOCK_L: tl.constexpr,
                                PDL: tl.constexpr):
    # no loop: the next kernel (W_UK's absorption) launches at once and loads its weight tile
    # while this one runs
    pdl.wait_and_release(PDL, True)
    token = tl.program_id(0).to(tl.int64)
    dtype = query_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]   # the queries' rope dims, every head
    q_rope = query_ptr + token * q_stride_t + heads * q_stride_h + NOPE + dims
    q_ok = (heads < num_heads) & (dims < HALF)
    _rotate_into(q_rope, q_rope, q_ok, q_ok, cos_ptr + token * cos_stride + dims,
                 sin_ptr + token * sin_stride + dims, HALF, dtype)
    tokens = token + tl.arange(0, 1)
    _store_latents(kv_a_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, tokens,
                   tokens >= 0, kv_a_stride, cos_stride, sin_stride, eps, LORA, HALF, BLOCK_L,
                   BLOCK_HALF, dtype)


def rotate_and_write_latent(query: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                            kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`kernels.mla_attention.rotate_and_write_latent`'s contract (shapes there), one program
    per token: the queries' rope dims rotated in place, the latent normalised, its rope part
    rotated, both stored at the token's slot (slot -1: not stored). Launched with PDL where
    `settings` has it on (`kernels.pdl`), releasing the next kernel right after its wait."""
    if not kv_cache.is_contiguous():
        raise ValueError("the MLA kv_cache must be contiguous ([num_blocks, block_size, "
                         "latent_dim]); the Triton kernels address it by slot.")
    num_tokens, num_heads, head_dim = query.shape
    rope_dim = cos.shape[-1]
    lora = kv_a.shape[-1] - rope_dim
    if num_tokens:
        options = pdl.launch_options(query.device, settings)
        _rotate_write_latent_kernel[(num_tokens,)](
            query, kv_a, norm_weight, cos, signed_sin, kv_cache, slot_mapping, query.stride(0),
            query.stride(1), kv_a.stride(0), cos.stride(0), signed_sin.stride(0), num_heads, eps,
            NOPE=head_dim - rope_dim, LORA=lora, HALF=rope_dim // 2,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
            BLOCK_L=triton.next_power_of_2(lora), PDL=bool(options), num_warps=4, **options)
    return query[..., head_dim - rope_dim:]


@triton.jit
def _absorb_query_kernel(q_ptr, w_ptr, out_ptr, num_tokens, q_st, q_sh, w_sh, w_sd, out_sh,
                         out_st, kv_a_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                         kv_a_stride, cos_stride, sin_stride, eps, NOPE: tl.constexpr,
                         LORA: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                         ROTATE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         BLOCK_LATENT: tl.constexpr):
    """Program (head, latent tile, token tile): q_latent = q_nope W_UK[head] for BLOCK_T
    tokens and BLOCK_L latent columns, one tl.dot over the whole nope width, fp32 accumulation.
    The W_UK tile (a weight) is loaded before the PDL wait, q_nope after.
    ROTATE (`rotate_write_and_attend`): the programs of latent tile 0 also rotate their head's
    query rope dims in place (right after q_nope's Dn dims, HALF x 2 of them), and head 0's
    store the tile's latents (`_store_latents`): `_rotate_write_latent_kernel`'s work, without
    its launch on the path to the attention."""
    head = tl.program_id(0)
    lat = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    tokens = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    t_ok = tokens < num_tokens
    d_ok = dims < NOPE
    l_ok = lat < LORA
    w = tl.load(w_ptr + head * w_sh + dims[:, None] * w_sd + lat[None, :],
                mask=d_ok[:, None] & l_ok[None, :], other=0.0)                 # [D, L]
    pdl.wait_and_release(PDL, True)
    rows = tokens[:, None].to(tl.int64)
    if ROTATE:
        if tl.program_id(1) == 0:
            dtype = q_ptr.dtype.element_ty
            half = tl.arange(0, BLOCK_HALF)[None, :]
            q_rope = q_ptr + rows * q_st + head * q_sh + NOPE + half
            q_ok = t_ok[:, None] & (half < HALF)
            _rotate_into(q_rope, q_rope, q_ok, q_ok, cos_ptr + rows * cos_stride + half,
                         sin_ptr + rows * sin_stride + half, HALF, dtype)
            if head == 0:
                _store_latents(kv_a_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                               tokens.to(tl.int64), t_ok, kv_a_stride, cos_stride, sin_stride,
                               eps, LORA, HALF, BLOCK_LATENT, BLOCK_HALF, dtype)
    q = tl.load(q_ptr + rows * q_st + head * q_sh + dims[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0)                 # [T, D]
    acc = tl.dot(q, w, input_precision=PRECISION)                              # [T, L] fp32
    tl.store(out_ptr + head * out_sh + rows * out_st + lat[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & l_ok[None, :])


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor, settings: KernelConfig = DEFAULT,
                 *, latent_step: tuple | None = None) -> torch.Tensor:
    """q_nope [T, H, Dn] (unit last stride) times W_UK [H, Dn, L] (unit last stride) per head:
    [H, T, L] contiguous, q_nope's dtype (what `torch.bmm(q_nope.transpose(0, 1), w_uk)`
    returns), in one Triton launch of H x L/64 x T/16 programs.

    latent_step: None, or (kv_a, norm_weight, eps, cos, signed_sin, kv_cache, slot_mapping)
        of `rotate_and_write_latent` (shapes there), q_nope then being the first Dn dims of
        its `query` [T, H, Dn + R]: the same launch also rotates the query's rope dims in
        place and stores the latents."""
    num_tokens, num_heads, nope = q_nope.shape
    lora = w_uk.shape[2]
    out = torch.empty(num_heads, num_tokens, lora, dtype=q_nope.dtype, device=q_nope.device)
    block_l = 64
    options = pdl.launch_options(q_nope.device, settings)
    if latent_step is None:   # placeholders, unused
        kv_a = norm = cos = sin = cache = slots = q_nope
        eps, rope_dim = 0.0, 2
    else:
        kv_a, norm, eps, cos, sin, cache, slots = latent_step
        rope_dim = cos.shape[-1]
    _absorb_query_kernel[(num_heads, triton.cdiv(lora, block_l), triton.cdiv(num_tokens, 16))](
        q_nope, w_uk, out, num_tokens, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0),
        w_uk.stride(1), out.stride(0), out.stride(1), kv_a, norm, cos, sin, cache, slots,
        kv_a.stride(0), cos.stride(0), sin.stride(0), eps, NOPE=nope, LORA=lora, BLOCK_T=16,
        BLOCK_D=max(16, triton.next_power_of_2(nope)), BLOCK_L=block_l,
        PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32", PDL=bool(options),
        ROTATE=latent_step is not None, HALF=rope_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
        BLOCK_LATENT=triton.next_power_of_2(lora), num_warps=4, **options)
    return out


def absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
             metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
             *, max_q_len: int, block_q: int | None = None, block_rows: int | None = None,
             splits: int | None = None, settings: KernelConfig = DEFAULT,
             q_latent: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA of the rows with <= max_q_len new tokens: [T, H, Dv] (other rows: garbage).

    q_latent = q_nope W_UK ([H, T, L]), latent attention, then o_latent W_UV^T. Up to
    `settings.mla_absorb_triton_max_tokens` tokens q_latent is `absorb_query`'s (Triton) and up
    to `settings.mla_reduce_uv_max_tokens` W_UV is applied in the split reduce; above, each is
    one cuBLAS batched GEMM; a given `q_latent` ([H, T, L]) is used as it is."""
    num_tokens = q_nope.shape[0]
    if q_latent is None:
        q_latent = (absorb_query(q_nope, w_uk, settings)              # [H, T, L]
                    if num_tokens <= settings.mla_absorb_triton_max_tokens
                    and w_uk.stride(2) == 1 else torch.bmm(q_nope.transpose(0, 1), w_uk))
    fuse_uv = num_tokens <= settings.mla_reduce_uv_max_tokens and w_uv.stride(2) == 1
    out = latent_attention(q_latent.transpose(0, 1), q_pe, kv_cache, metadata, scale,
                           max_q_len=max_q_len, block_q=block_q, block_rows=block_rows,
                           splits=splits, heads_major=True,
                           w_uv=w_uv if fuse_uv else None, settings=settings)
    if fuse_uv:
        return out                                                     # [T, H, Dv]
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                  scale: float, settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`kernels.mla_attention.mla_attention`'s contract (shapes there); see the module
    docstring for which rows run which kernel."""
    if not kv_cache.is_contiguous():
        raise ValueError("the MLA kv_cache must be contiguous ([num_blocks, block_size, "
                         "latent_dim]); the Triton kernels address it by slot.")
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    num_tokens, num_heads = q_nope.shape[:2]
    if num_tokens == 0:
        return q_nope.new_empty(0, num_heads, w_uv.shape[1])
    max_decode = settings.mla_decode_max_query_len
    if metadata.max_query_len <= max_decode:
        return absorbed(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                        max_q_len=metadata.max_query_len, settings=settings)
    if settings.mla_prefill == "absorbed":
        return absorbed(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                        max_q_len=metadata.max_query_len, block_rows=64,
                        block_q=max(1, 64 // triton.next_power_of_2(num_heads)), splits=1,
                        settings=settings)
    chunks = [i for i, n in enumerate(metadata.query_lens_cpu) if n > max_decode]
    if len(chunks) < metadata.num_seqs:   # decode rows too: absorbed first, chunks overwrite
        longest = max(n for n in metadata.query_lens_cpu if n <= max_decode)
        out = absorbed(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                       max_q_len=longest, settings=settings).contiguous()
    else:
        out = q_nope.new_empty(num_tokens, num_heads, w_uv.shape[1])
    if settings.mla_prefill == "auto":   # fresh chunks (no cached prefix): SDPA
        lens = metadata.query_lens_cpu
        fresh = [c for c in chunks if lens[c] == metadata.seq_lens_cpu[c]]
        for chunk in fresh:
            first = sum(lens[:chunk])
            rows = slice(first, first + lens[chunk])
            out[rows] = prefill_expanded(q_nope[rows], q_pe[rows], kv_cache,
                                         metadata.block_tables[chunk],
                                         metadata.seq_lens_cpu[chunk], w_uk, w_uv, scale)
        chunks = [c for c in chunks if c not in fresh]
    mla_prefill(q_nope, q_pe, kv_cache, metadata, chunks, w_uk, w_uv, scale, out, settings)
    return out


def kernel_available() -> bool:
    """True when a CUDA device is present (Triton itself imported with this module)."""
    return torch.cuda.is_available()


def rotate_write_and_attend(query: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                            kv_cache: torch.Tensor, metadata: AttentionMetadata,
                            w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                            settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`kernels.mla_attention.rotate_write_and_attend`'s contract (shapes there). A decode
    batch (rows of <= `mla_decode_max_query_len` tokens) of at most
    `mla_absorb_triton_max_tokens` tokens, with `settings.mla_rotate_in_absorb`, rotates and
    stores its latents inside the W_UK absorption kernel (`absorb_query`'s `latent_step`):
    one launch less on the attention's critical path; other batches run
    `rotate_and_write_latent` then `mla_attention`."""
    rope_dim = cos.shape[-1]
    nope = query.shape[2] - rope_dim
    q_nope, q_pe = query[..., :nope], query[..., nope:]
    if (settings.mla_rotate_in_absorb and query.stride(-1) == 1 and w_uk.stride(2) == 1
            and 0 < query.shape[0] <= settings.mla_absorb_triton_max_tokens
            and metadata.max_query_len <= settings.mla_decode_max_query_len):
        if not kv_cache.is_contiguous():
            raise ValueError("the MLA kv_cache must be contiguous ([num_blocks, block_size, "
                             "latent_dim]); the Triton kernels address it by slot.")
        q_latent = absorb_query(q_nope, w_uk, settings, latent_step=(
            kv_a, norm_weight, eps, cos, signed_sin, kv_cache, metadata.slot_mapping))
        return absorbed(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                        max_q_len=metadata.max_query_len, settings=settings, q_latent=q_latent)
    rotate_and_write_latent(query, kv_a, norm_weight, eps, cos, signed_sin, kv_cache,
                            metadata.slot_mapping, settings=settings)
    return mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale, settings=settings)


# tokens per batch-invariant attention call: bounds its split partials (tokens x heads x 2 x
# kv_lora_rank float32: 134 MB at DeepSeek-V3's 128 heads)
EVERY_TOKEN_CHUNK = 256


def every_token(query: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                scale: float, settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """`rotate_write_and_attend` in the batch-invariant form (`KernelConfig.batch_invariant`):
    each new token is a decode row of its own over its own context (the sequence's block table
    row, its position + 1 positions), so its bits do not depend on the batch, on prefill
    chunking or on prefix hits: W_UK absorbed by `absorb_query` (16-token tiles whatever the
    count), the absorbed decode kernel at 2 fixed splits (a token's split boundaries depend on
    its context length only) with W_UV applied in the split reduce. Graph-safe (the per-token
    metadata is built on the device). Shapes: `rotate_write_and_attend`'s."""
    rotate_and_write_latent(query, kv_a, norm_weight, eps, cos, signed_sin, kv_cache,
                            metadata.slot_mapping, settings=settings)
    num_tokens, num_heads = query.shape[:2]
    nope = query.shape[2] - cos.shape[-1]
    q_nope, q_pe = query[..., :nope], query[..., nope:]
    out = query.new_empty(num_tokens, num_heads, w_uv.shape[1])
    if num_tokens == 0:
        return out
    tokens = torch.arange(num_tokens, device=query.device, dtype=torch.int32)
    ends = metadata.query_start_loc[1:]
    seq = torch.searchsorted(ends, tokens, right=True).clamp_(max=metadata.num_seqs - 1)
    # positions each token sees; tokens past the last row (graph padding) read one position
    context = (metadata.seq_lens[seq] - (ends[seq] - 1 - tokens)).clamp_(min=1).to(torch.int32)
    tables = metadata.block_tables.index_select(0, seq)
    w_uk = w_uk if w_uk.stride(2) == 1 else w_uk.contiguous()
    w_uv = w_uv if w_uv.stride(2) == 1 else w_uv.contiguous()
    for start in range(0, num_tokens, EVERY_TOKEN_CHUNK):
        rows = slice(start, min(num_tokens, start + EVERY_TOKEN_CHUNK))
        count = rows.stop - rows.start
        per_token = AttentionMetadata(
            query_start_loc=torch.arange(count + 1, device=query.device, dtype=torch.int32),
            seq_lens=context[rows], block_tables=tables[rows],
            slot_mapping=metadata.slot_mapping[rows], max_query_len=1,
            max_seq_len=metadata.max_seq_len, query_lens_cpu=[1] * count,
            seq_lens_cpu=[metadata.max_seq_len] * count)
        q_latent = absorb_query(q_nope[rows], w_uk, settings)                # [H, n, L]
        out[rows] = latent_attention(q_latent.transpose(0, 1), q_pe[rows], kv_cache, per_token,
                                     scale, max_q_len=1, block_q=1,
                                     block_rows=settings.mla_decode_block_h, splits=2,
                                     heads_major=True, w_uv=w_uv, settings=settings)
    return out
