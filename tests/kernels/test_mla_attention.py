"""Paged MLA attention and latent write: every backend against the float32 reference (which
computes the expanded per-head K/V form token by token).

Tolerances: float32 within atol 2e-5 / rtol 1e-5 of the reference (the absorbed decode path
sums in a different order); bfloat16 within atol 3e-2. Latent writes are copies: exact.
"""

import pytest
import torch
from test_paged_attention import CASES, make_batch

from deepinfer.kernels.mla_attention import BACKENDS, mla_attention, write_latent
from deepinfer.kernels.mla_attention_torch import decode_absorbed, prefill_expanded

pytestmark = pytest.mark.usefixtures("torch_single_thread")
# CPU-tensor backends; "triton" / "flash_mla" (CUDA) are tested in test_mla_attention_triton.py
FAST_BACKENDS = [name for name in BACKENDS if name not in ("reference", "triton", "flash_mla")]
KV_LORA_RANK, ROPE_DIM = 32, 16


def make_mla_batch(case, block_size, dtype=torch.float32, seed=0):
    """(latent cache [num_blocks, block_size, L + R], metadata) with shuffled block tables."""
    query_lens, seq_lens = CASES[case]
    kv_cache, metadata = make_batch(query_lens, seq_lens, block_size, 1,
                                    KV_LORA_RANK + ROPE_DIM, dtype, seed=seed)
    return kv_cache[0, :, :, 0].contiguous(), metadata


def make_inputs(num_tokens, num_heads, nope_dim, v_dim, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(num_tokens, num_heads, nope_dim, generator=gen).to(dtype)
    q_pe = torch.randn(num_tokens, num_heads, ROPE_DIM, generator=gen).to(dtype)
    w_uk = (torch.randn(num_heads, nope_dim, KV_LORA_RANK, generator=gen) * 0.2).to(dtype)
    w_uv = (torch.randn(num_heads, v_dim, KV_LORA_RANK, generator=gen) * 0.2).to(dtype)
    return q_nope, q_pe, w_uk, w_uv


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_heads,nope_dim,v_dim", [(4, 16, 24), (3, 32, 32)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mla_attention_matches_reference(backend, case, num_heads, nope_dim, v_dim,
                                         block_size):
    kv_cache, metadata = make_mla_batch(case, block_size)
    # a step that scores drafts: the torch backend's verify rows run absorbed in one batch
    metadata.has_draft_rows = case == "verify"
    q_nope, q_pe, w_uk, w_uv = make_inputs(sum(CASES[case][0]), num_heads, nope_dim, v_dim)
    scale = (nope_dim + ROPE_DIM) ** -0.5
    expected = mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale,
                             backend="reference")
    actual = mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale, backend=backend)
    assert actual.shape == (q_nope.shape[0], num_heads, v_dim) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


def test_absorbed_decode_equals_expanded_form():
    """The two forms of MLA (V2 report §2.1.2) give the same output for one new token."""
    kv_cache, metadata = make_mla_batch("single_decode", 8)
    q_nope, q_pe, w_uk, w_uv = make_inputs(1, 4, 16, 24)
    absorbed = decode_absorbed(q_nope, q_pe, kv_cache, metadata.block_tables, metadata.seq_lens,
                               metadata.max_seq_len, w_uk, w_uv, 0.2)
    expanded = prefill_expanded(q_nope, q_pe, kv_cache, metadata.block_tables[0],
                                metadata.seq_lens_cpu[0], w_uk, w_uv, 0.2)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_mla_attention_bfloat16(backend):
    kv_cache, metadata = make_mla_batch("mixed", 8, torch.bfloat16)
    q_nope, q_pe, w_uk, w_uv = make_inputs(16, 4, 16, 24, torch.bfloat16)
    args = (q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, 0.2)
    expected = mla_attention(*args, backend="reference")
    actual = mla_attention(*args, backend=backend)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_write_latent_matches_reference_and_skips_negative_slots(backend):
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(5, KV_LORA_RANK + ROPE_DIM, generator=gen)
    slots = torch.tensor([3, 17, -1, 0, 30])
    expected = torch.zeros(4, 8, KV_LORA_RANK + ROPE_DIM)
    actual = expected.clone()
    write_latent(latent, expected, slots, backend="reference")
    write_latent(latent, actual, slots, backend=backend)
    assert torch.equal(actual, expected)
    assert torch.equal(actual[2, 1], latent[1]) and torch.equal(actual[3, 6], latent[4])
    assert int((actual.abs().sum(-1) > 0).sum()) == 4  # the -1 slot wrote nothing


def test_unknown_backend_is_refused():
    kv_cache, metadata = make_mla_batch("single_decode", 8)
    q_nope, q_pe, w_uk, w_uv = make_inputs(1, 4, 16, 24)
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        mla_attention(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, 0.2, backend="nope")
