"""Gluon skinny GEMM (kernels/linear_gluon.py) against the Triton kernel it stands in for and
F.linear in float64, on a Hopper GPU.

Both kernels accumulate in float32 and round once, in different summation orders: outputs agree
to bf16 rounding (relative error vs float64 < 1e-2, as tests/kernels/test_linear_triton.py).
The Gluon path is reached through `linear_triton.linear` with every row bucket in
`KernelConfig.gluon_block_m`, so the same argument checks, partial buffers and arrival counters
are used.
"""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gpu_common import DEVICE, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    DEVICE != "cuda" or not torch.cuda.is_available()
    or torch.cuda.get_device_capability()[0] != 9, reason="Hopper GPU (TMA, wgmma)")]

PLAIN = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
WIDE = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}
SPLIT = {**PLAIN, "SPLIT_K": 2}
# 128- and 256-row weight tiles (x read once for two or four wgmma row blocks; 256: one box
# per stage), split K
WIDE_SPLIT = {**WIDE, "SPLIT_K": 2}
WIDEST_SPLIT = {**PLAIN, "BLOCK_N": 256, "SPLIT_K": 4}


def _randn(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.fixture
def gluon():
    """`linear_triton.linear` with every row bucket on Gluon (one program per output tile and
    K split), as `gluon.linear`."""
    from deepinfer.kernels import linear_triton
    from deepinfer.kernels.settings import KernelConfig

    every_bucket = KernelConfig(gluon_block_m=frozenset({16, 32, 64}))
    return SimpleNamespace(linear=functools.partial(linear_triton.linear, settings=every_bucket))


def _rms_normed(x, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("num_rows", [64, 48, 33, 32, 17, 16, 1])
@pytest.mark.parametrize("config", [PLAIN, WIDE, SPLIT, WIDE_SPLIT, WIDEST_SPLIT],
                         ids=["plain", "wide", "split_k", "wide_split_k", "widest_split_k"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gluon_linear_matches_f_linear(gluon, num_rows, config, with_bias):
    x = _randn(num_rows, 1024, seed=1)
    weight = _randn(320, 1024, seed=2, scale=1024 ** -0.5)     # ragged last N tile
    bias = _randn(320, seed=3) if with_bias else None
    got = gluon.linear(x, weight, bias, config=config)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert relative_error(got, expected) < 1e-2
    assert torch.equal(gluon.linear(x, weight, bias, config=config), got)   # deterministic


@pytest.mark.parametrize("gated", [False, True], ids=["norm", "norm_gated"])
def test_gluon_norm_without_sums_of_squares_runs_the_triton_kernel(gluon, gated):
    """A norm GEMM given no handed-over sums of squares (the first layer's) needs the Triton
    kernel's pass over x: the Gluon path is not taken, and the result is right."""
    eps = 1e-5
    x = _randn(64, 512, seed=51, scale=3.0)
    weight = _randn(2 * 128 if gated else 128, 512, seed=52, scale=512 ** -0.5)
    got = gluon.linear(x, weight, config=PLAIN, norm_eps=eps, gated=gated)
    product = F.linear(_rms_normed(x, eps), weight.double())
    if gated:
        product = F.silu(product[:, :128]) * product[:, 128:]
    assert relative_error(got, product) < 1e-2


@pytest.mark.parametrize("gated, norm_config", [(False, PLAIN), (True, PLAIN), (True, WIDE)],
                         ids=["norm", "norm_gated", "norm_gated_wide"])
@pytest.mark.parametrize("num_rows", [64, 5])
def test_gluon_norm_from_handed_over_sums_of_squares(gluon, gated, norm_config, num_rows):
    """The residual GEMM writes its rows' sums of squares; the norm GEMM reads them: as the
    unfused RMSNorm then linear (SiLU-gated); 128-row gated tiles take one box per stage."""
    eps = 1e-5
    x = _randn(num_rows, 512, seed=11)
    w_o = _randn(1024, 512, seed=12, scale=512 ** -0.5)
    residual = _randn(num_rows, 1024, seed=13, scale=3.0)
    expected_stream = residual.double() + F.linear(x.double(), w_o.double())
    partials = torch.empty(1024 // 64, num_rows, dtype=torch.float32, device=DEVICE)
    stream = gluon.linear(x, w_o, config=SPLIT, residual=residual, sum_squares_out=partials)
    assert relative_error(stream, expected_stream) < 1e-2
    assert relative_error(partials.double().sum(0), stream.double().pow(2).sum(-1)) < 1e-5

    weight = _randn(2 * 192 if gated else 192, 1024, seed=14, scale=1024 ** -0.5)
    got = gluon.linear(stream, weight, config=norm_config, norm_eps=eps, gated=gated,
                       sum_squares=partials)
    product = F.linear(_rms_normed(stream, eps), weight.double())
    if gated:
        product = F.silu(product[:, :192]) * product[:, 192:]
    assert relative_error(got, product) < 1e-2


def test_gluon_ragged_k_and_an_empty_trailing_split(gluon):
    """K = 200: the last K tile is cut by the TMA box's zero fill; three splits of 128-column
    tiles leave the third without a tile (it adds zeros, as the Triton kernel's do)."""
    x = _randn(64, 200, seed=61)
    weight = _randn(128, 200, seed=62, scale=200 ** -0.5)
    got = gluon.linear(x, weight, config={**PLAIN, "SPLIT_K": 3})
    assert relative_error(got, F.linear(x.double(), weight.double())) < 1e-2


def test_gluon_split_k_replays_in_a_cuda_graph_and_leaves_counters_at_zero(gluon):
    from deepinfer.kernels.backends import arrival_counters

    x = _randn(64, 2048, seed=21)
    weight = _randn(512, 2048, seed=22, scale=2048 ** -0.5)
    gluon.linear(x, weight, config=SPLIT)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gluon.linear(x, weight, config=SPLIT)
    for seed in range(23, 26):
        x.copy_(_randn(64, 2048, seed=seed))
        graph.replay()
        assert relative_error(out, F.linear(x.double(), weight.double())) < 1e-2
    torch.cuda.synchronize()
    assert not arrival_counters(x.device).any()


def test_gluon_agrees_with_the_triton_kernel(gluon):
    from deepinfer.kernels import linear_triton
    from deepinfer.kernels.settings import KernelConfig

    x = _randn(64, 4096, seed=31)
    weight = _randn(1024, 4096, seed=32, scale=4096 ** -0.5)
    got = gluon.linear(x, weight, config=SPLIT)
    triton_out = linear_triton.linear(x, weight, config=SPLIT,
                                      settings=KernelConfig(gluon_block_m=frozenset()))
    assert relative_error(got, triton_out.double()) < 4e-3


def test_gluon_row_argmax_epilogue(gluon):
    from deepinfer.kernels.linear_triton import linear_row_argmax

    x = _randn(64, 1024, seed=41)
    weight = _randn(1000, 1024, seed=42, scale=1024 ** -0.5)
    weight[900] = weight[100] = 0.05          # equal, leading logits in two tiles
    out, ids = linear_row_argmax(x.abs(), weight, config=WIDE)
    assert torch.equal(ids, out.argmax(dim=-1)) and torch.equal(ids, torch.full_like(ids, 100))


def test_gluon_rows_do_not_depend_on_the_batch(gluon):
    """Within a row bucket a row's bits do not depend on the other rows (batch invariance):
    the tiles depend on N and K only."""
    x = _randn(64, 2048, seed=71)
    weight = _randn(704, 2048, seed=72, scale=2048 ** -0.5)
    full = gluon.linear(x, weight, config=SPLIT)
    assert torch.equal(gluon.linear(x[:40].clone(), weight, config=SPLIT), full[:40])
