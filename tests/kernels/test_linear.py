"""Packed CPU linear against F.linear. Tolerance: float32, atol 1e-4 for K <= 1536 with O(1)
inputs (different summation order only)."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.linear import linear, pack_linear_weight


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(num_tokens, with_bias):
    weight = torch.randn(320, 192) / 192 ** 0.5
    bias = torch.randn(320) if with_bias else None
    packed = pack_linear_weight(weight)
    if packed is None:
        pytest.skip("torch built without oneDNN: no packed path to test")
    x = torch.randn(num_tokens, 192)
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)


def test_packed_linear_reads_strided_input():
    weight = torch.randn(64, 48)
    packed = pack_linear_weight(weight)
    if packed is None:
        pytest.skip("torch built without oneDNN: no packed path to test")
    x = torch.randn(48, 7).t()  # [7, 48] non-contiguous
    torch.testing.assert_close(linear(x, weight, None, packed), F.linear(x, weight),
                               atol=1e-4, rtol=1e-4)


def test_packing_does_not_apply_to_half_precision():
    assert pack_linear_weight(torch.randn(8, 8).to(torch.bfloat16)) is None
    x, weight = torch.randn(2, 8).to(torch.bfloat16), torch.randn(4, 8).to(torch.bfloat16)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
