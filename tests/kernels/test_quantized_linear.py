"""Block-quantized linear: exact recovery of Q4_1 / Q8_0 from float32, kernel vs reference.

Weights are quantized in the test with gguf-py (llama.cpp's rules) and dequantized to float32,
as the GGUF loader does. Tolerance of the AVX2 kernel against the reference (dequantize +
F.linear): rtol 1e-5 of the output's max magnitude; both use the same exact float32 weights,
so only the summation order differs (K <= 1536).
"""

import numpy as np
import pytest
import torch

import deepinfer.kernels.quantized_linear as ql
from deepinfer.kernels.linear import linear, quantize_linear_weight
from deepinfer.kernels.settings import DEFAULT
from deepinfer.kernels.quantized_linear import (QuantizedWeight, cpu_kernel_available, quantized_linear,
                                      recover_q4_1, recover_q8_0, recover_quantized)
from deepinfer.kernels.reference.quantized_linear import dequantize

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

# (N, K) of SmolLM2-135M's linears: fused qkv, o, fused gate/up, down; a slice of the LM head.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]


def ggml_roundtrip(weight: torch.Tensor, qtype) -> torch.Tensor:
    """[N, K] float32 -> the float32 values llama.cpp's quantize + dequantize give."""
    blocks = gguf_quants.quantize(weight.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(blocks, qtype)))


def random_weight(num_rows, num_cols, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_cols, generator=gen) * 0.05


@pytest.mark.parametrize("shape", [(64, 64), (96, 576)])
def test_q4_1_recovery_is_bit_exact(shape):
    weight = ggml_roundtrip(random_weight(*shape), GGMLQuantizationType.Q4_1)
    qweight = recover_q4_1(weight)
    assert qweight is not None and qweight.format == "q4_1"
    assert qweight.codes.shape == (shape[0], shape[1] // 2) and qweight.codes.dtype == torch.uint8
    assert qweight.scales.shape == (shape[0], shape[1] // 32)
    assert torch.equal(dequantize(qweight), weight)
    assert recover_quantized(weight).format == "q4_1"


@pytest.mark.parametrize("shape", [(64, 64), (96, 576)])
def test_q8_0_recovery_is_bit_exact(shape):
    weight = ggml_roundtrip(random_weight(*shape, seed=1), GGMLQuantizationType.Q8_0)
    qweight = recover_q8_0(weight)
    assert qweight is not None and qweight.format == "q8_0"
    assert qweight.codes.dtype == torch.int8 and qweight.mins is None
    assert torch.equal(dequantize(qweight), weight)
    assert recover_q4_1(weight) is None  # Q8_0 data has more than 16 levels per block
    assert recover_quantized(weight).format == "q8_0"


def test_recovery_handles_constant_and_zero_blocks():
    weight = ggml_roundtrip(random_weight(4, 64), GGMLQuantizationType.Q4_1)
    weight[0, :32] = 0.0
    weight[1, 32:] = 0.5  # a constant block: d = 0, m = 0.5
    qweight = recover_q4_1(weight)
    assert qweight is not None and torch.equal(dequantize(qweight), weight)


def test_recovery_rejects_plain_float32_and_bad_shapes():
    assert recover_q4_1(random_weight(64, 64)) is None
    assert recover_q8_0(random_weight(64, 64)) is None
    one_off = ggml_roundtrip(random_weight(64, 64), GGMLQuantizationType.Q8_0)
    one_off[7, 9] = torch.nextafter(one_off[7, 9], torch.tensor(1.0))  # one block fails
    assert recover_quantized(one_off) is None
    assert recover_quantized(torch.zeros(8, 48)) is None                 # K not a multiple of 32
    assert recover_quantized(torch.zeros(8, 64, dtype=torch.float64)) is None
    assert quantize_linear_weight(ggml_roundtrip(random_weight(8, 64),
                                                 GGMLQuantizationType.Q4_1).half()) is None


def _model_like_qweight(fmt, shape, seed):
    qtype = GGMLQuantizationType.Q4_1 if fmt == "q4_1" else GGMLQuantizationType.Q8_0
    qweight = recover_quantized(ggml_roundtrip(random_weight(*shape, seed=seed), qtype))
    assert qweight is not None and qweight.format == fmt
    return qweight


@pytest.mark.parametrize("backend", ql.BACKENDS)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 33, 100])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_quantized_linear_matches_reference(backend, fmt, num_rows, shape):
    if backend == "cpu_avx2" and not cpu_kernel_available():
        pytest.skip("AVX2 quantized-linear kernel unavailable here (no AVX2 or no compiler)")
    qweight = _model_like_qweight(fmt, shape, seed=num_rows)
    x = torch.randn(num_rows, shape[1], generator=torch.Generator().manual_seed(7))
    expected = torch.nn.functional.linear(x, dequantize(qweight))
    got = quantized_linear(x, qweight, backend=backend)
    assert got.shape == (num_rows, shape[0]) and got.dtype == torch.float32
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-5 * scale


def _kernel_linear(x, qweight, allow_avx512):
    """The extension's entry point with the AVX-512 few-row nest allowed or not."""
    ext = ql._cpu_extension()
    if qweight.format == "q4_1":
        return ext.q4_1_linear(x, qweight.codes, qweight.scales, qweight.mins,
                               allow_avx512=allow_avx512)
    return ext.q8_0_linear(x, qweight.codes, qweight.scales, allow_avx512=allow_avx512)


@pytest.mark.parametrize("allow_avx512", [False, True], ids=["avx2", "avx512"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 24])
def test_quantized_linear_tile_edges_match_reference(allow_avx512, fmt, num_rows):
    """Every tile shape of the fused nest (one tile of M <= 7 rows in AVX2, M <= 8 in AVX-512
    where the CPU has it; each weight dequantized once) and of the dequantized-panel nest (AVX2
    from M = 8, both from M = 9: 4-row tiles with tails, 3-row / 24-row output panels with tails
    at N = 53); K = 2112 (66 blocks) crosses the 64-block scale chunk. Tolerance: 1e-5 of the
    output's max magnitude (float32 summation order)."""
    if not cpu_kernel_available():
        pytest.skip("AVX2 quantized-linear kernel unavailable here")
    if allow_avx512 and not ql._cpu_extension().avx512_available():
        pytest.skip("this CPU has no AVX-512F: the AVX2 nest runs (the avx2 case)")
    qweight = _model_like_qweight(fmt, (53, 2112), seed=num_rows)
    x = torch.randn(num_rows, 2112, generator=torch.Generator().manual_seed(11))
    expected = torch.nn.functional.linear(x, dequantize(qweight))
    got = _kernel_linear(x, qweight, allow_avx512)
    assert got.shape == (num_rows, 53)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    strided = torch.randn(num_rows, 4096, generator=torch.Generator().manual_seed(12))[:, 7:2119]
    expected = torch.nn.functional.linear(strided, dequantize(qweight))   # row stride 4096
    got = _kernel_linear(strided, qweight, allow_avx512)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_avx512_rows_do_not_depend_on_the_row_count(fmt):
    """In the AVX-512 nest a row's summation order is the same at every M <= 8: a decode row
    and the same row inside a verify step (M = 6) come out bitwise equal."""
    if not cpu_kernel_available() or not ql._cpu_extension().avx512_available():
        pytest.skip("needs the CPU extension on a CPU with AVX-512F")
    qweight = _model_like_qweight(fmt, (53, 2112), seed=21)
    x = torch.randn(8, 2112, generator=torch.Generator().manual_seed(13))
    alone = torch.cat([_kernel_linear(x[r:r + 1], qweight, True) for r in range(8)])
    for num_rows in range(2, 9):
        assert torch.equal(_kernel_linear(x[:num_rows], qweight, True), alone[:num_rows])


def test_quantized_linear_bias_strided_input_and_leading_dims():
    qweight = _model_like_qweight("q4_1", (64, 96), seed=3)
    bias = torch.randn(64)
    x = torch.randn(96, 10).t()                                  # [10, 96], non-contiguous
    expected = torch.nn.functional.linear(x, dequantize(qweight), bias)
    torch.testing.assert_close(quantized_linear(x, qweight, bias), expected, rtol=1e-5,
                               atol=1e-5)
    x3 = torch.randn(2, 5, 96)
    torch.testing.assert_close(quantized_linear(x3, qweight),
                               torch.nn.functional.linear(x3, dequantize(qweight)),
                               rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_rejected():
    qweight = _model_like_qweight("q8_0", (32, 64), seed=4)
    with pytest.raises(ValueError, match="backend"):
        quantized_linear(torch.randn(1, 64), qweight, backend="cuda_magic")


def test_linear_uses_float32_path_when_extension_unavailable(monkeypatch):
    weight = ggml_roundtrip(random_weight(48, 64), GGMLQuantizationType.Q4_1)
    qweight = quantize_linear_weight(weight)
    assert isinstance(qweight, QuantizedWeight)
    monkeypatch.setattr(ql, "_cpu_extension", lambda: None)
    x = torch.randn(3, 64)
    # linear falls back to F.linear; the public op's "auto" falls back to the reference.
    assert torch.equal(linear(x, weight, None, None, qweight),
                       torch.nn.functional.linear(x, weight))
    torch.testing.assert_close(quantized_linear(x, qweight), x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="unavailable"):
        quantized_linear(x, qweight, backend="cpu_avx2")


def test_linear_dispatches_small_inputs_to_quantized_kernel(monkeypatch):
    if not cpu_kernel_available():
        pytest.skip("AVX2 quantized-linear kernel unavailable here")
    weight = ggml_roundtrip(random_weight(48, 64), GGMLQuantizationType.Q8_0)
    qweight = quantize_linear_weight(weight)
    calls = []
    real = ql._cpu_avx2_linear
    monkeypatch.setattr(ql, "_cpu_avx2_linear",
                        lambda x, q, invariant: calls.append(x.shape) or real(x, q, invariant))
    for num_rows in (1, DEFAULT.quantized_max_rows, DEFAULT.quantized_max_rows + 1):
        x = torch.randn(num_rows, 64)
        torch.testing.assert_close(linear(x, weight, None, None, qweight), x @ weight.T,
                                   rtol=1e-5, atol=1e-5)
    assert calls == [(1, 64), (DEFAULT.quantized_max_rows, 64)]  # more rows: float32 GEMM
