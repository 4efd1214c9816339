"""The persistent layer kernel (kernels/linear_gluon_layer.py) against the four Gluon GEMM
launches it replaces (bitwise: same tiles, same accumulation order, same epilogues) and against
float64 math (bf16 rounding), on a Hopper GPU.

Shapes are small (hidden 1024, intermediate 2048, qkv 1536) so most runs give each program
one tile per GEMM; `programs=7` makes programs run several tiles of a GEMM, the next tile's
weights requested across the epilogue of the one before.
"""

import pytest
import torch

from gpu_common import DEVICE, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    DEVICE != "cuda" or not torch.cuda.is_available()
    or torch.cuda.get_device_capability()[0] != 9, reason="Hopper GPU (TMA, wgmma)")]

HIDDEN, INTERMEDIATE, QKV = 1024, 2048, 1536
EPS_MLP, EPS_QKV = 1e-5, 1e-6


def _randn(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)


def _operands(rows, with_qkv=True):
    attn_out = _randn(rows, HIDDEN, seed=1)
    hidden = _randn(rows, HIDDEN, seed=2)
    weights = (_randn(HIDDEN, HIDDEN, seed=3, scale=HIDDEN ** -0.5),
               _randn(2 * INTERMEDIATE, HIDDEN, seed=4, scale=HIDDEN ** -0.5),
               _randn(HIDDEN, INTERMEDIATE, seed=5, scale=INTERMEDIATE ** -0.5),
               _randn(QKV, HIDDEN, seed=6, scale=HIDDEN ** -0.5) if with_qkv else None)
    return attn_out, hidden, weights


def _run(launch, attn_out, hidden, weights, splits, **kwargs):
    from deepinfer.kernels import pdl

    stream = hidden.clone()
    qkv, sum_squares = launch(attn_out, stream, *weights, EPS_MLP, EPS_QKV, o_split=splits[0],
                              down_split=splits[1], pdl_options=pdl.launch_options(stream.device),
                              **kwargs)
    return stream, qkv, sum_squares


def _reference(attn_out, hidden, weights):
    """float64: the stream after o and the MLP, and the next qkv (RMSNorm weights folded)."""
    o_w, gu_w, dn_w, qkv_w = (None if w is None else w.double() for w in weights)

    def normed(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    stream = hidden.double() + attn_out.double() @ o_w.T
    gate, up = (normed(stream, EPS_MLP) @ gu_w.T).chunk(2, dim=-1)
    stream = stream + (gate * torch.sigmoid(gate) * up) @ dn_w.T
    qkv = normed(stream, EPS_QKV) @ qkv_w.T if qkv_w is not None else None
    return stream, qkv


@pytest.mark.parametrize("rows", [64, 40, 1])
@pytest.mark.parametrize("splits", [(2, 2), (1, 1), (1, 3)], ids=["split_2_2", "one", "1_3"])
@pytest.mark.parametrize("programs", [None, 7], ids=["per_sm", "7_programs"])
@pytest.mark.parametrize("with_qkv", [True, False], ids=["next_qkv", "last_layer"])
def test_layer_kernel_bitwise_equals_four_launches(rows, splits, programs, with_qkv):
    from deepinfer.kernels import linear_gluon_layer as layer

    attn_out, hidden, weights = _operands(rows, with_qkv)
    want = _run(layer.launch_separately, attn_out, hidden, weights, splits)
    for _ in range(2):      # the second launch checks that the counters were reset
        got = _run(layer.launch, attn_out, hidden, weights, splits, programs=programs)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
        if with_qkv:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        else:
            assert got[1] is None
    stream, qkv = _reference(attn_out, hidden, weights)
    assert relative_error(got[0], stream) < 1e-2
    if with_qkv:
        assert relative_error(got[1], qkv) < 2e-2
    # the handed-over sums of squares are the new stream's (rounded) rows'
    torch.testing.assert_close(got[2].sum(0), got[0].float().pow(2).sum(-1), rtol=1e-5,
                               atol=0)


def test_layer_kernel_chained_in_a_cuda_graph():
    """Eight layers' kernels back to back (PDL on), captured and replayed: each replay gives
    the eager chain's results (the counters start each launch at zero)."""
    from deepinfer.kernels import linear_gluon_layer as layer
    from deepinfer.kernels import pdl

    attn_out, hidden, weights = _operands(64)
    options = pdl.launch_options(hidden.device)
    stream = hidden.clone()

    def chain():
        for _ in range(8):
            qkv, _ = layer.launch(attn_out, stream, *weights, EPS_MLP, EPS_QKV, o_split=2,
                                  down_split=2, pdl_options=options)
        return qkv

    stream.copy_(hidden)
    want_qkv, want_stream = chain().clone(), stream.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv = chain()
    for _ in range(3):
        stream.copy_(hidden)
        graph.replay()
        torch.testing.assert_close(stream, want_stream, rtol=0, atol=0)
        torch.testing.assert_close(qkv, want_qkv, rtol=0, atol=0)
