"""MoE expert computation: every backend against the loop-over-experts reference.

Tolerances: float32 within atol 1e-5 / rtol 1e-5 (same GEMMs, different row grouping);
bfloat16 within atol 2e-2.
"""

import pytest
import torch

from deepinfer.kernels.moe import BACKENDS, moe_experts

pytestmark = pytest.mark.usefixtures("torch_single_thread")
# "triton" and "deep_gemm" are tested in test_moe_triton.py (CUDA or the Triton interpreter)
FAST_BACKENDS = [name for name in BACKENDS if name not in ("reference", "triton", "deep_gemm")]


def make_moe(num_tokens, num_experts, top_k, hidden=32, inter=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    return hidden_states, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (7, 8, 3), (33, 16, 4),
                                                          (5, 64, 6)])
def test_moe_experts_match_reference(backend, num_tokens, num_experts, top_k):
    args = make_moe(num_tokens, num_experts, top_k)
    expected = moe_experts(*args, backend="reference")
    actual = moe_experts(*args, backend=backend)
    assert actual.shape == args[0].shape and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_reference_is_the_weighted_sum_of_expert_mlps():
    hidden, w13, w2, weights, ids = make_moe(3, 4, 2)
    out = moe_experts(hidden, w13, w2, weights, ids, backend="reference")
    for token in range(3):
        expected = torch.zeros(hidden.shape[1])
        for k in range(2):
            gate, up = (w13[ids[token, k]] @ hidden[token]).chunk(2)
            expected += weights[token, k] * (w2[ids[token, k]] @ (torch.nn.functional.silu(gate)
                                                                  * up))
        torch.testing.assert_close(out[token], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_moe_experts_bfloat16(backend):
    args = make_moe(9, 8, 2, dtype=torch.bfloat16)
    expected = moe_experts(*args, backend="reference")
    actual = moe_experts(*args, backend=backend)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=1e-2)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        moe_experts(*make_moe(1, 4, 1), backend="nope")
