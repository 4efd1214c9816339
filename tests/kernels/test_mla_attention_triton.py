"""Triton MLA (decode kernel, prefill kernel, latent write) vs the float32 reference.

Tolerances (relative error ||out - ref|| / ||ref||): float32 inputs 1e-5 (IEEE dots; only the
summation order and the absorbed-vs-expanded association differ); bfloat16 2e-2 (q_latent, P
and the latent output rounded to bf16). Latent writes are copies: exact.
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 with the small cases (gpu_common.py).
"""

import sys
import types
from dataclasses import replace

import pytest
import torch

from deepinfer.kernels import mla_attention as mla_op
from deepinfer.kernels.reference import mla_attention as reference
from deepinfer.kernels.settings import KernelConfig
from gpu_common import DEVICE, random_paged_batch, relative_error, requires_triton

pytestmark = [pytest.mark.gpu, requires_triton]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]

CASES = {
    # name: (query_lens, context_lens (cached before the step), H, Dn, Dv, L, R, block_size)
    "decode_ragged": ([1, 1, 1, 1], [0, 16, 32, 70], 4, 16, 24, 32, 16, 4),
    "decode_block16_heads20": ([1, 1], [69, 32], 20, 16, 16, 32, 16, 16),
    "spec_rows_1plus_k": ([3, 1, 2, 4], [9, 39, 3, 20], 4, 16, 24, 32, 16, 8),
    "prefill_fresh": ([5, 16, 23], [0, 0, 0], 4, 16, 24, 32, 16, 4),
    "prefill_prefix_hit": ([20, 12], [45, 9], 4, 16, 16, 32, 16, 16),
    "mixed": ([1, 9, 1, 12, 2], [39, 0, 1, 7, 14], 4, 16, 24, 32, 16, 16),
}
if DEVICE == "cuda":   # DeepSeek-V2-Lite / V3 shapes (too slow for the interpreter)
    CASES.update({
        "v2lite_decode_b64": ([1] * 64, [i * 37 % 2000 for i in range(64)], 16, 128, 128, 512,
                              64, 64),
        "v3_decode_heads128": ([1, 1, 1], [900, 1, 300], 128, 128, 128, 512, 64, 64),
        "v2lite_spec_block16": ([2, 4, 1], [500, 33, 1200], 16, 128, 128, 512, 64, 16),
        "v2lite_prefill_prefix": ([300, 1, 129], [256, 700, 0], 16, 128, 128, 512, 64, 64),
    })


def _batch(case, dtype, seed=0):
    query_lens, context_lens, heads, nope, v_dim, lora, rope, block_size = CASES[case]
    _, kv_cache, metadata = random_paged_batch(
        query_lens, context_lens, num_q_heads=1, num_kv_heads=1, head_dim=lora + rope,
        block_size=block_size, dtype=dtype, seed=seed)
    kv_cache = kv_cache[0, :, :, 0].contiguous()   # [num_blocks, block_size, L + R]
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = sum(query_lens)
    q_nope = torch.randn(tokens, heads, nope, generator=gen)
    q_pe = torch.randn(tokens, heads, rope, generator=gen)
    w_uk = torch.randn(heads, nope, lora, generator=gen) * lora ** -0.5
    w_uv = torch.randn(heads, v_dim, lora, generator=gen) * lora ** -0.5
    tensors = [t.to(dtype).to(DEVICE) for t in (q_nope, q_pe, w_uk, w_uv)]
    return (*tensors, kv_cache, metadata, (nope + rope) ** -0.5)


def _on_cpu(metadata):
    return replace(metadata, query_start_loc=metadata.query_start_loc.cpu(),
                   seq_lens=metadata.seq_lens.cpu(), block_tables=metadata.block_tables.cpu(),
                   slot_mapping=metadata.slot_mapping.cpu())


def _reference(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale):
    args = [t.float().cpu() for t in (q_nope, q_pe, kv_cache)]
    return reference.mla_attention(*args, _on_cpu(metadata), w_uk.float().cpu(),
                                   w_uv.float().cpu(), scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_mla_triton_matches_reference(case, dtype):
    q_nope, q_pe, w_uk, w_uv, kv_cache, metadata, scale = _batch(case, dtype)
    out = mla_op.mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                               backend="triton")
    assert out.shape == (q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    assert out.dtype == dtype
    expected = _reference(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("settings", [KernelConfig(mla_prefill="absorbed"),
                                      KernelConfig(mla_prefill="expanded"),
                                      KernelConfig(mla_decode_max_splits=1),
                                      KernelConfig(mla_decode_max_query_len=1),
                                      KernelConfig(mla_absorb_triton_max_tokens=0,
                                                   mla_reduce_uv_max_tokens=0),
                                      KernelConfig(mla_absorb_triton_max_tokens=64,
                                                   mla_reduce_uv_max_tokens=64)],
                         ids=["absorbed_prefill", "triton_expanded_prefill", "one_split",
                              "spec_rows_as_prefill", "cublas_projections",
                              "fused_projections_mixed"])
def test_mla_triton_settings_variants(settings):
    """The absorbed prefill, the Triton kernel for fresh chunks too, the unsplit decode (with
    W_UV in the reduce: two splits, one empty), multi-token rows through the prefill kernel,
    W_UK / W_UV by cuBLAS, and the Triton W_UK + reduce-applied W_UV for the decode rows of a
    batch with prefill chunks compute the same attention."""
    case = "mixed" if settings.mla_decode_max_query_len > 1 else "spec_rows_1plus_k"
    q_nope, q_pe, w_uk, w_uv, kv_cache, metadata, scale = _batch(case, torch.float32)
    out = mla_op.mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                               backend="triton", settings=settings)
    expected = _reference(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_absorb_query_matches_bmm(num_tokens, dtype):
    """The Triton W_UK projection against torch.bmm on q_nope's strided view (query's first Dn
    dims of Dn + R): float32 1e-5, bf16 1e-2 relative (one bf16 rounding of the output)."""
    from deepinfer.kernels.mla_attention_triton import absorb_query

    heads, nope, rope, lora = (16, 128, 64, 512) if DEVICE == "cuda" else (4, 16, 8, 32)
    gen = torch.Generator().manual_seed(num_tokens)
    query = torch.randn(num_tokens, heads, nope + rope, generator=gen).to(dtype).to(DEVICE)
    kv_b = torch.randn(heads, 2 * nope, lora, generator=gen).to(dtype).to(DEVICE) * 0.05
    q_nope, w_uk = query[..., :nope], kv_b[:, :nope]                  # strided views
    out = absorb_query(q_nope, w_uk)
    expected = torch.bmm(q_nope.float().transpose(0, 1), w_uk.float())
    assert out.shape == (heads, num_tokens, lora) and out.dtype == dtype
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_mla_triton_write_latent_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(5, 48, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 30], device=DEVICE)
    expected = torch.zeros(4, 8, 48, device=DEVICE)
    actual = expected.clone()
    reference.write_latent(latent.cpu(), expected_cpu := expected.cpu(), slots.cpu())
    mla_op.write_latent(latent, actual, slots, backend="triton")
    assert torch.equal(actual.cpu(), expected_cpu)
    assert int((actual.abs().sum(-1) > 0).sum()) == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_tokens", [(16, 1), (16, 7), (20, 33)])
def test_rotate_and_write_latent_matches_torch_ops(num_heads, num_tokens, dtype):
    """The one-kernel rotary + latent norm + latent write equals the torch ops it replaces
    (`kernels.rotary.apply_rotary`, `kernels.rms_norm`, `write_latent`, backend "torch"):
    float32 within 1e-6 (the norm's sum order), bf16 within one ulp (2**-7 relative); nope
    dims untouched, slot -1 not stored (V2-Lite's widths: Dn 128, R 64, L 512)."""
    from deepinfer.engine.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(num_tokens)
    nope, rope_dim, lora = 128, 64, 512
    query = torch.randn(num_tokens, num_heads, nope + rope_dim, generator=gen).to(DEVICE, dtype)
    kv_a = torch.randn(num_tokens, lora + rope_dim, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(lora, generator=gen)).to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(rope_dim, 4096, {"rope_type": "default", "rope_theta": 1e4}).to(
        DEVICE)(positions, dtype)
    slots = torch.randperm(4 * 16, generator=gen)[:num_tokens].to(DEVICE)
    slots[num_tokens // 2] = -1
    caches, queries = [], []
    for backend in ("triton", "torch"):
        cache = torch.zeros(4, 16, lora + rope_dim, device=DEVICE, dtype=dtype)
        q = query.clone()
        q_pe = mla_op.rotate_and_write_latent(q, kv_a, weight, 1e-6, cos, sin, cache, slots,
                                              backend=backend)
        assert q_pe.data_ptr() == q[..., nope:].data_ptr()
        caches.append(cache)
        queries.append(q)
    assert torch.equal(queries[0][..., :nope], query[..., :nope])
    assert int((caches[0].abs().sum(-1) > 0).sum()) == num_tokens - 1
    atol = 1e-6 if dtype == torch.float32 else 0
    for got, expected in ((queries[0], queries[1]), (caches[0], caches[1])):
        rtol = 1e-6 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["decode_ragged", "spec_rows_1plus_k", "mixed"])
def test_rotate_write_and_attend_matches_the_separate_ops(case, dtype):
    """Rotation and latent write folded into the W_UK absorption kernel (decode batches,
    `mla_rotate_in_absorb`) give what `rotate_and_write_latent` then `mla_attention` give:
    the same rotated queries bit for bit; the same latents and attention output bit for bit
    in bf16, in float32 within 1e-6 / 1e-5 (the norm sums 16 tokens' rows in one block, in
    another order); a batch with prefill chunks ("mixed") takes the separate ops."""
    from deepinfer.engine.models.layers.rotary import RotaryEmbedding

    q_nope, q_pe, w_uk, w_uv, kv_cache, metadata, scale = _batch(case, dtype)
    gen = torch.Generator().manual_seed(7)
    tokens, heads, nope = q_nope.shape
    rope_dim, lora = q_pe.shape[2], kv_cache.shape[2] - q_pe.shape[2]
    query = torch.cat([q_nope, q_pe], dim=2)
    kv_a = torch.randn(tokens, lora + rope_dim, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(lora, generator=gen)).to(DEVICE, dtype)
    positions = (metadata.seq_lens.cpu().repeat_interleave(torch.tensor(
        [int(n) for n in metadata.query_lens_cpu])) - 1).to(DEVICE)
    cos, sin = RotaryEmbedding(rope_dim, 4096, {"rope_type": "default", "rope_theta": 1e4}).to(
        DEVICE)(positions, dtype)
    results = []
    for fused in (True, False):
        settings = KernelConfig(mla_rotate_in_absorb=fused)
        cache, q = kv_cache.clone(), query.clone()
        out = mla_op.rotate_write_and_attend(q, kv_a, weight, 1e-6, cos, sin, cache, metadata,
                                             w_uk, w_uv, scale, backend="triton",
                                             settings=settings)
        results.append((q, cache, out))
    (q_fused, cache_fused, out_fused), (q_apart, cache_apart, out_apart) = results
    assert torch.equal(q_fused, q_apart)
    assert not torch.equal(cache_fused, kv_cache)   # this step's latents were stored
    if dtype == torch.float32:
        torch.testing.assert_close(cache_fused, cache_apart, rtol=1e-6, atol=1e-6)
        assert relative_error(out_fused, out_apart) < 1e-5
    else:
        assert torch.equal(cache_fused, cache_apart) and torch.equal(out_fused, out_apart)


def test_auto_picks_flash_mla_when_installed(monkeypatch):
    """Dispatch only (FlashMLA does not build here): with a stand-in `flash_mla` module, auto
    resolves to it on CUDA, covered batches call its two functions with FlashMLA's shapes, and
    uncovered ones (block size 16) fall back to the Triton kernel."""
    from deepinfer.kernels import mla_attention_flashmla as flash

    calls = []

    def get_mla_metadata(seq_lens, rows, kv_heads):
        calls.append(("plan", rows, kv_heads))
        return "plan", "splits"

    def flash_mla_with_kvcache(q, cache, tables, seq_lens, v_dim, plan, splits, *,
                               softmax_scale, causal):
        calls.append(("run", tuple(q.shape), tuple(cache.shape), v_dim, causal))
        return q.new_zeros(*q.shape[:3], v_dim), None

    fake = types.SimpleNamespace(get_mla_metadata=get_mla_metadata,
                                 flash_mla_with_kvcache=flash_mla_with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    monkeypatch.setattr(flash, "library_available", lambda: True)
    assert mla_op.resolve_backend("auto", torch.device("cuda")) == "flash_mla"
    assert mla_op.resolve_backend("auto", torch.device("cpu")) == "torch"
    blocks = torch.zeros(3, 64, 576, dtype=torch.bfloat16, device=DEVICE)
    q_nope = torch.zeros(4, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    q_pe = torch.zeros(4, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    w_uk = torch.zeros(16, 128, 512, dtype=torch.bfloat16, device=DEVICE)
    w_uv = torch.zeros(16, 128, 512, dtype=torch.bfloat16, device=DEVICE)
    metadata = replace(_batch("decode_ragged", torch.float32)[5], max_seq_len=3,
                       seq_lens_cpu=[1, 1, 1, 1])
    metadata.block_tables = torch.zeros(4, 1, dtype=torch.int32, device=DEVICE)
    metadata.seq_lens = torch.ones(4, dtype=torch.int32, device=DEVICE)
    if DEVICE == "cuda":
        out = flash.mla_attention(q_nope, q_pe, blocks, metadata, w_uk, w_uv, 0.1)
        assert out.shape == (4, 16, 128)
        assert calls == [("plan", 16, 1), ("run", (4, 1, 16, 576), (3, 64, 1, 576), 512, True)]
    assert not flash.covers(q_nope, blocks[:, :16].contiguous(), metadata, w_uk)
    assert flash.covers(q_nope.to(DEVICE), blocks, metadata, w_uk) == (DEVICE == "cuda")
