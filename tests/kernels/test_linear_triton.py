"""Triton skinny GEMM (kernels/linear_triton.py) against F.linear in float64.

Tolerances (relative error ||out - ref|| / ||ref||, float64 reference on the same inputs):
float32 1e-5 (IEEE dot products, another summation order); bfloat16 1e-2 (the output is
rounded to bf16: ~4e-3). Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (float32 only there).
"""

import pytest
import torch
import torch.nn.functional as F

from gpu_common import DEVICE, relative_error, requires_triton
from deepinfer.kernels.backends import arrival_counters

pytestmark = [pytest.mark.gpu, requires_triton]

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SMALL = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
LARGE = {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
SPLIT = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2, "SPLIT_K": 3}
SWAP = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2, "SWAP_AB": True}
SWAP_SPLIT = {**SWAP, "SPLIT_K": 2}


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _reference(x, weight, bias=None):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_rows, out_features, in_features, with_bias", [
    (1, 64, 128, False),    # even tiles
    (3, 40, 200, True),     # ragged N and K, bias
    (17, 96, 64, False),    # two row tiles of 16
])
@pytest.mark.parametrize("config", [SMALL, LARGE, SPLIT, SWAP, SWAP_SPLIT],
                         ids=["small", "large", "split_k", "swap_ab", "swap_ab_split_k"])
def test_skinny_linear_matches_f_linear(dtype, num_rows, out_features, in_features,
                                        with_bias, config):
    from deepinfer.kernels.linear_triton import linear

    x = _randn(num_rows, in_features, dtype=dtype, seed=1)
    weight = _randn(out_features, in_features, dtype=dtype, seed=2, scale=in_features ** -0.5)
    bias = _randn(out_features, dtype=dtype, seed=3) if with_bias else None
    got = linear(x, weight, bias, config=config)
    assert got.shape == (num_rows, out_features) and got.dtype == dtype
    assert relative_error(got, _reference(x, weight, bias)) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_rows, in_features, split_k", [
    (64, 512, 4),     # even splits, one 64-row tile
    (5, 200, 4),      # ragged K: the last split gets a partial tile, ...
    (2, 64, 3),       # ... or no tile at all (it adds zeros)
])
def test_split_k_is_deterministic_and_leaves_its_counters_at_zero(num_rows, in_features,
                                                                   split_k):
    """The split arriving last sums the partials in split order: repeated calls give the same
    bits; every call leaves the arrival counters at zero for the next one."""
    from deepinfer.kernels import linear_triton

    dtype = DTYPES[-1]
    config = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2, "SPLIT_K": split_k}
    x = _randn(num_rows, in_features, dtype=dtype, seed=11)
    weight = _randn(96, in_features, dtype=dtype, seed=12, scale=in_features ** -0.5)
    bias = _randn(96, dtype=dtype, seed=13)
    first = linear_triton.linear(x, weight, bias, config=config)
    assert relative_error(first, _reference(x, weight, bias)) < TOLERANCE[dtype]
    for _ in range(3):
        assert torch.equal(linear_triton.linear(x, weight, bias, config=config), first)
    assert not arrival_counters(x.device).any()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_split_k_replays_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the counters reset by the last split keep every
    replay right (bf16, the 64-row decode shape of o_proj, scaled down)."""
    from deepinfer.kernels import linear_triton

    config = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "SPLIT_K": 4}
    x = _randn(64, 1024, dtype=torch.bfloat16, seed=14)
    weight = _randn(1024, 1024, dtype=torch.bfloat16, seed=15, scale=1024 ** -0.5)
    linear_triton.linear(x, weight, config=config)   # compile, counters: outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_triton.linear(x, weight, config=config)
    for seed in range(16, 20):
        x.copy_(_randn(64, 1024, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        assert relative_error(out, _reference(x, weight)) < 1e-2
    torch.cuda.synchronize()
    assert not arrival_counters(x.device).any()


def test_skinny_linear_reads_strided_rows():
    from deepinfer.kernels.linear_triton import linear

    dtype = DTYPES[-1]
    wide = _randn(4, 256, dtype=dtype, seed=6)
    x = wide[:, :128]                                          # row stride 256
    weight = _randn(32, 128, dtype=dtype, seed=7, scale=128 ** -0.5)
    got = linear(x, weight, config=SMALL)
    assert relative_error(got, _reference(x, weight)) < TOLERANCE[dtype]


@pytest.mark.skipif(DEVICE != "cuda", reason="dispatch to Triton happens on CUDA only")
def test_linear_dispatch_takes_triton_for_tuned_decode_shapes_only(monkeypatch, tmp_path):
    """kernels.linear.linear: bf16 CUDA inputs of <= `KernelConfig.skinny_max_rows` rows go to the skinny
    kernel where the device's config file marks the shape faster than cuBLAS; other shapes,
    more rows and float32 go to F.linear."""
    import json

    from deepinfer.kernels import backends, linear_triton
    from deepinfer.kernels import linear as linear_module

    name = torch.cuda.get_device_name()
    monkeypatch.setattr(backends, "CONFIG_DIR", tmp_path)
    entries = [{"block_m": 16, "out_features": 64, "in_features": 128, "config": SMALL,
                "triton_faster": True},
               {"block_m": 16, "out_features": 32, "in_features": 128, "config": SMALL,
                "triton_faster": False}]
    backends.device_config_path(linear_triton.CONFIG_KIND, name).write_text(
        json.dumps({"entries": entries}))
    backends.tuned_table.cache_clear()
    calls = []
    real = linear_triton.linear
    monkeypatch.setattr(linear_triton, "linear",
                        lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    try:
        weight = _randn(64, 128, dtype=torch.bfloat16, seed=8, scale=128 ** -0.5)
        x = _randn(16, 128, dtype=torch.bfloat16, seed=9)
        got = linear_module.linear(x, weight)
        assert calls == [(64, 128)]
        assert relative_error(got, _reference(x, weight)) < 1e-2
        linear_module.linear(x, weight[:32])                       # cuBLAS was faster
        linear_module.linear(_randn(17, 128, dtype=torch.bfloat16, seed=10), weight)  # bucket 32
        linear_module.linear(x.float(), weight.float())
        assert calls == [(64, 128)]
    finally:
        backends.tuned_table.cache_clear()


def _rms_normed(x, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_rows, in_features", [(1, 128), (3, 200), (17, 64)])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("config", [SMALL, SWAP], ids=["x_w", "swap_ab"])
def test_norm_and_gated_epilogues_match_the_unfused_ops(dtype, num_rows, in_features, gated,
                                                        config):
    """norm_eps: (x / rms(x)) @ W.T with the sums of squares taken in the K loop (ragged K and
    two row tiles included); gated: silu(x @ gate.T) * (x @ up.T) from one [2I, K] weight."""
    from deepinfer.kernels.linear_triton import linear

    eps = 1e-5
    x = _randn(num_rows, in_features, dtype=dtype, seed=21, scale=3.0)
    weight = _randn(2 * 48, in_features, dtype=dtype, seed=22, scale=in_features ** -0.5)
    got = linear(x, weight, config=config, norm_eps=eps, gated=gated)
    product = F.linear(_rms_normed(x, eps), weight.double())              # [M, 96]
    if gated:
        gate, up = product[:, :48], product[:, 48:]
        product = F.silu(gate) * up
    assert got.shape == product.shape and got.dtype == dtype
    assert relative_error(got, product) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [SMALL, SPLIT, SWAP_SPLIT],
                         ids=["one_split", "split_k", "swap_ab_split_k"])
def test_residual_epilogue_adds_into_the_residual_in_place(dtype, config):
    """residual + x @ W.T (+ bias) is written into `residual`, which is returned; split-K adds
    it once, in the split that arrives last."""
    from deepinfer.kernels.linear_triton import linear

    x = _randn(5, 200, dtype=dtype, seed=31)
    weight = _randn(40, 200, dtype=dtype, seed=32, scale=200 ** -0.5)
    bias = _randn(40, dtype=dtype, seed=33)
    residual = _randn(5, 40, dtype=dtype, seed=34)
    expected = residual.double() + _reference(x, weight, bias)
    got = linear(x, weight, bias, config=config, residual=residual)
    assert got.data_ptr() == residual.data_ptr()
    assert relative_error(residual, expected) < TOLERANCE[dtype]


def test_norm_and_gated_refuse_split_k_and_gated_refuses_a_bias():
    from deepinfer.kernels.linear_triton import linear

    x = _randn(2, 64, dtype=DTYPES[-1], seed=41)
    weight = _randn(64, 64, dtype=DTYPES[-1], seed=42)
    with pytest.raises(ValueError, match="SPLIT_K=1"):
        linear(x, weight, config=SPLIT, norm_eps=1e-6)
    with pytest.raises(ValueError, match="SPLIT_K=1"):
        linear(x, weight, config=SPLIT, gated=True)
    with pytest.raises(ValueError, match="no bias"):
        linear(x, weight, weight[:, 0], config=SMALL, gated=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_rows", [5, 17])
@pytest.mark.parametrize("config", [SMALL, SPLIT, SWAP_SPLIT],
                         ids=["one_split", "split_k", "swap_ab_split_k"])
def test_residual_gemm_hands_its_rows_sums_of_squares_to_the_next_norm(dtype, num_rows, config):
    """sum_squares_out holds, per output tile (ragged last tile included), the row sums of
    squares of the stored new residual; a norm GEMM given them as sum_squares computes
    (x / rms(x)) @ W.T from them alone (scaled partials scale the result by their root)."""
    from deepinfer.kernels.linear_triton import linear, num_partials

    eps = 1e-6
    x = _randn(num_rows, 200, dtype=dtype, seed=51)
    weight = _randn(40, 200, dtype=dtype, seed=52, scale=200 ** -0.5)
    residual = _randn(num_rows, 40, dtype=dtype, seed=53)
    tiles = num_partials(40, config)
    partials = torch.empty((tiles, num_rows), dtype=torch.float32, device=DEVICE)
    stream = linear(x, weight, config=config, residual=residual, sum_squares_out=partials)
    block_n = config["BLOCK_N"]
    expected = torch.stack([stream[:, t * block_n:(t + 1) * block_n].double().pow(2).sum(1)
                            for t in range(tiles)])
    assert relative_error(partials, expected) < 1e-6
    next_weight = _randn(2 * 48, 40, dtype=dtype, seed=54, scale=40 ** -0.5)
    for gated in (False, True):
        got = linear(stream, next_weight, config=SMALL, norm_eps=eps, gated=gated,
                     sum_squares=partials)
        product = F.linear(_rms_normed(stream, eps), next_weight.double())
        if gated:
            product = F.silu(product[:, :48]) * product[:, 48:]
        assert relative_error(got, product) < TOLERANCE[dtype]
    halved = linear(stream, next_weight, config=SMALL, norm_eps=eps, sum_squares=partials * 4)
    assert relative_error(halved, F.linear(_rms_normed(stream, eps), next_weight.double()) / 2
                          ) < TOLERANCE[dtype]


def test_sums_of_squares_arguments_are_checked():
    from deepinfer.kernels.linear_triton import linear

    x = _randn(3, 64, dtype=DTYPES[-1], seed=55)
    weight = _randn(64, 64, dtype=DTYPES[-1], seed=56)
    parts = torch.zeros((2, 3), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="pass norm_eps"):
        linear(x, weight, config=SMALL, sum_squares=parts)
    with pytest.raises(ValueError, match="pass residual"):
        linear(x, weight, config=SMALL, sum_squares_out=parts)
    with pytest.raises(ValueError, match=r"float32 \[2, 3\]"):
        linear(x, weight, config=SMALL, residual=x.clone(), sum_squares_out=parts[:, :2])
    with pytest.raises(ValueError, match="not both"):
        linear(x, weight, config=SMALL, norm_eps=1e-6, sum_squares=parts, sum_squares_out=parts)


@pytest.mark.parametrize("num_rows", [1, 5, 17])
@pytest.mark.parametrize("config", [SMALL, SPLIT, SWAP], ids=["one_split", "split_k", "swap_ab"])
def test_row_argmax_epilogue_gives_the_first_maximal_column(num_rows, config):
    """linear_row_argmax: the output of `linear` unchanged, and out.argmax(-1) exactly, ties
    to the lowest column (two equal weight rows, in different tiles, lead every row)."""
    from deepinfer.kernels.linear_triton import linear, linear_row_argmax

    dtype = DTYPES[-1]
    x = _randn(num_rows, 200, dtype=dtype, seed=51).abs()
    weight = _randn(150, 200, dtype=dtype, seed=52, scale=200 ** -0.5)
    plain = linear(x, weight, config=config)
    out, ids = linear_row_argmax(x, weight, config=config)
    assert torch.equal(out, plain)
    assert ids.dtype == torch.int64 and torch.equal(ids, plain.argmax(dim=-1))
    weight[40] = weight[130] = 1.0            # the same, largest logit in columns 40 and 130
    out, ids = linear_row_argmax(x, weight, config=config)
    assert torch.equal(ids, torch.full_like(ids, 40))
    assert torch.equal(ids, out.argmax(dim=-1))


def test_row_maxima_arguments_are_checked():
    from deepinfer.kernels.linear_triton import linear

    x = _randn(2, 64, dtype=DTYPES[-1], seed=53)
    weight = _randn(64, 64, dtype=DTYPES[-1], seed=54)
    wrong = (torch.empty(1, 2, device=DEVICE), torch.empty(1, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="row maxima"):
        linear(x, weight, config=SMALL, row_maxima_out=wrong)
