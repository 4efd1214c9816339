"""Triton RMSNorm(+residual), rotary and SiLU-and-mul vs their torch references.

Tolerances (relative error ||out - ref|| / ||ref||, float64): float32 1e-5; bfloat16 1e-2 (the
kernels follow the references' rounding steps; an element may still differ by one bf16 ulp
where float32 sums are ordered differently). The residual stream written in place must match
exactly (one rounded add in both). Runs on CUDA, or on CPU under TRITON_INTERPRET=1.
"""

import pytest
import torch

from gpu_common import DEVICE, relative_error, requires_triton
from deepinfer.kernels.reference import activation, rms_norm, rotary

pytestmark = [pytest.mark.gpu, requires_triton]

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _triton():
    from deepinfer.kernels import elementwise_triton

    return elementwise_triton


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    x, weight = _randn(5, 96, dtype=dtype, seed=1), _randn(96, dtype=dtype, seed=2)
    residual = _randn(5, 96, dtype=dtype, seed=3) if with_residual else None
    x_ref = x.clone()
    expected = rms_norm.rms_norm(x_ref, weight, 1e-6, residual)
    got = _triton().rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], expected[1]) and got[1] is x
        got, expected = got[0], expected[0]
    assert relative_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_on_strided_view(dtype):
    fused = _randn(6, 7 * 32, dtype=dtype, seed=4)             # [T, (Hq + Hkv + Hv) * D]
    x = fused[:, :5 * 32].view(6, 5, 32)                        # q and k heads, strided rows
    table = _randn(6, 2, 32, dtype=dtype, seed=5)                 # [T, 2, D] as RotaryEmbedding
    cos, sin = table[:, 0:1], table[:, 1:2]
    got = _triton().apply_rotary(x, cos, sin)
    expected = rotary.apply_rotary(x, cos, sin)
    assert got.is_contiguous() and got.shape == (6, 5, 32)
    assert relative_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    gate_up = _randn(3, 2 * 1500, dtype=dtype, seed=6)           # I = 1500: two column tiles
    got = _triton().silu_and_mul(gate_up)
    expected = activation.silu_and_mul(gate_up)
    assert got.shape == (3, 1500)
    assert relative_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 80])
def test_rotary_write_kv_matches_rotary_then_write_kv(dtype, head_dim):
    """The fused kernel against the reference pair (apply_rotary, then write_kv): query and
    written slots within the rotary tolerance, bit-equal to the unfused Triton rotary kernel
    (same rounding steps); slot -1 and unaddressed slots keep their old values exactly."""
    from deepinfer.kernels.rotary import apply_rotary_write_kv

    num_q, num_kv, num_tokens = 4, 2, 5
    qkv = _randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype, seed=7)
    table = _randn(num_tokens, 2, head_dim, dtype=dtype, seed=8)
    cos, sin = table[:, 0:1], table[:, 1:2]
    cache = _randn(2, 6, 4, num_kv, head_dim, dtype=dtype, seed=9)     # 6 blocks of 4 slots
    slots = torch.tensor([3, 17, -1, 0, 22], dtype=torch.int64, device=DEVICE)
    expected_cache = cache.clone()
    expected = apply_rotary_write_kv(qkv, num_q, num_kv, cos, sin, expected_cache, slots,
                                     backend="reference")
    before = cache.clone()
    got = apply_rotary_write_kv(qkv, num_q, num_kv, cos, sin, cache, slots, backend="triton")
    assert got.shape == (num_tokens, num_q, head_dim) and got.is_contiguous()
    assert relative_error(got, expected) < TOLERANCE[dtype]
    assert relative_error(cache, expected_cache) < TOLERANCE[dtype]
    unfused = _triton().apply_rotary(qkv[:, :(num_q + num_kv) * head_dim].view(
        num_tokens, -1, head_dim), cos, sin)                           # [T, Hq + Hkv, D]
    assert torch.equal(got, unfused[:, :num_q])
    flat = cache.view(2, -1, num_kv, head_dim)                         # [2, slots, Hkv, D]
    written = [3, 17, 0, 22]
    assert torch.equal(flat[0, written], unfused[[0, 1, 3, 4], num_q:])
    assert torch.equal(flat[1, written], qkv[[0, 1, 3, 4], (num_q + num_kv) * head_dim:].view(
        4, num_kv, head_dim))
    untouched = [s for s in range(flat.shape[1]) if s not in written]
    assert torch.equal(flat[:, untouched], before.view(2, -1, num_kv, head_dim)[:, untouched])
