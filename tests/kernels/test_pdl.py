"""Programmatic Dependent Launch of the decode-step Triton kernels (kernels/pdl.py).

PDL changes when a kernel starts, never what it computes, so what is checked is: the switches
(`use_pdl` is off on CPU, under the Triton interpreter, before sm_90 and with PDL_ENABLED False;
wide kernels only with PDL_WIDE_KERNELS); on an H100/H200 the kernels carry the `griddepcontrol`
instructions (and the skinny GEMM its L2 prefetch); and CUDA graphs of real op chains with PDL
on, wide kernels included or not (norm -> GEMM -> SiLU-mul -> split-K GEMM; rotary + KV write ->
split-K paged decode) give bit-equal outputs to the same chains run eagerly with PDL off,
replayed on new inputs.
"""

import importlib.util
import os

import pytest
import torch

from kernels import pdl

HOPPER = (torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
          and os.environ.get("TRITON_INTERPRET") != "1"
          and torch.cuda.get_device_capability() >= (9, 0))
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90+ CUDA device + Triton")
SMALL = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}


def test_off_on_cpu():
    assert not pdl.use_pdl(torch.device("cpu"))


def test_switches(monkeypatch):
    """Where CUDA reports sm_90 PDL is on, unless PDL_ENABLED is False or Triton interprets;
    wide kernels only with PDL_WIDE_KERNELS; sm_80 never (the capability is faked: no GPU
    needed)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(pdl, "PDL_WIDE_KERNELS", False)
    assert pdl.use_pdl(cuda) and not pdl.use_pdl(cuda, wide=True)
    monkeypatch.setattr(pdl, "PDL_WIDE_KERNELS", True)
    assert pdl.use_pdl(cuda) and pdl.use_pdl(cuda, wide=True)
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert not pdl.use_pdl(cuda) and not pdl.use_pdl(cuda, wide=True)
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.use_pdl(cuda) and not pdl.use_pdl(cuda, wide=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "_capability", lambda index: (8, 0))
    assert not pdl.use_pdl(cuda) and not pdl.use_pdl(cuda, wide=True)


def _randn(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()


@pytest.mark.gpu
@requires_hopper
def test_skinny_kernel_carries_gdc_and_prefetch():
    """The PTX of a PDL launch holds both griddepcontrol instructions and the bulk L2 prefetch
    (none of them removed as dead code); a launch without PDL holds none."""
    from kernels import linear_triton

    x, weight = _randn(4, 256, seed=1), _randn(64, 256, seed=2, scale=1 / 16)
    out = torch.empty(4, 64, dtype=x.dtype, device="cuda")
    ptx = {}
    for on in (False, True):
        kernel = linear_triton._skinny_linear_kernel[(2, 1, 1)](
            x, weight, weight, out, out, out, 4, 64, 256, 256, x.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=False, BLOCK_M=16, SPLIT_K=1, EVEN_N=True, EVEN_K=True,
            PRECISION="tf32", USE_PDL=on, PREFETCH_K=256 if on else 0, launch_pdl=on, **SMALL)
        ptx[on] = kernel.asm["ptx"]
        torch.cuda.synchronize()
        assert torch.equal(out, linear_triton.linear(x, weight, config=SMALL))
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                        "cp.async.bulk.prefetch.L2.global"):
        assert instruction in ptx[True] and instruction not in ptx[False]


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("num_rows, out_features, in_features, split_k", [
    (3, 40, 100, 1),   # 200-byte rows: odd rows start off 16 bytes (no prefetch), ragged N, K
    (5, 96, 200, 3),   # split-K, a ragged last split
])
def test_skinny_linear_with_pdl_is_bit_equal(monkeypatch, num_rows, out_features, in_features,
                                             split_k):
    from kernels.linear_triton import linear

    x = _randn(num_rows, in_features, seed=3)
    weight = _randn(out_features, in_features, seed=4, scale=in_features ** -0.5)
    bias = _randn(out_features, seed=5)
    config = dict(SMALL, SPLIT_K=split_k)
    monkeypatch.setattr(pdl, "PDL_WIDE_KERNELS", True)
    assert pdl.use_pdl(x.device, wide=True)
    got = linear(x, weight, bias, config=config)
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert torch.equal(got, linear(x, weight, bias, config=config))


def _replay_matches_eager(monkeypatch, wide, inputs, run, new_inputs):
    """Capture `run()` (reading `inputs`, a list of static tensors) in a CUDA graph with PDL
    on (for the wide kernels too if `wide`); for each of `new_inputs` (lists like `inputs`)
    copy them in, replay, and compare the graph's outputs bit for bit with `run()` called
    eagerly on clones with PDL off. `run(*tensors)` returns a tuple of tensors (state it
    writes in place included)."""
    monkeypatch.setattr(pdl, "PDL_WIDE_KERNELS", wide)
    assert pdl.use_pdl(inputs[0].device) and pdl.use_pdl(inputs[0].device, wide=True) == wide
    run(*[t.clone() for t in inputs])           # compiles, makes the split-K counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run(*inputs)
    for values in new_inputs:
        for static, value in zip(inputs, values):
            static.copy_(value)
        eager_inputs = [t.clone() for t in inputs]
        graph.replay()
        with monkeypatch.context() as patch:
            patch.setattr(pdl, "PDL_ENABLED", False)
            expected = run(*eager_inputs)
        torch.cuda.synchronize()
        for got, want in zip(outputs, expected, strict=True):
            assert torch.equal(got, want)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("wide", [False, True], ids=["small_kernels", "wide_kernels_too"])
def test_graph_of_mlp_chain_with_pdl_is_bit_equal(monkeypatch, wide):
    """Residual RMSNorm -> gate_up GEMM -> SiLU-mul -> split-K down GEMM, as in an MLP block."""
    from kernels import elementwise_triton
    from kernels.linear_triton import linear

    hidden, intermediate, rows = 256, 512, 4
    norm_weight = _randn(hidden, seed=10)
    w_gate_up = _randn(2 * intermediate, hidden, seed=11, scale=hidden ** -0.5)
    w_down = _randn(hidden, intermediate, seed=12, scale=intermediate ** -0.5)

    def run(x, residual):
        normed, residual_out = elementwise_triton.rms_norm(x, norm_weight, 1e-6, residual)
        gate_up = linear(normed, w_gate_up, config=SMALL)
        act = elementwise_triton.silu_and_mul(gate_up)
        return linear(act, w_down, config=dict(SMALL, SPLIT_K=2)), residual_out

    inputs = [_randn(rows, hidden, seed=20), _randn(rows, hidden, seed=21)]
    new = [[_randn(rows, hidden, seed=30 + 2 * i), _randn(rows, hidden, seed=31 + 2 * i)]
           for i in range(3)]
    _replay_matches_eager(monkeypatch, wide, inputs, run, new)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("wide", [False, True], ids=["small_kernels", "wide_kernels_too"])
def test_graph_of_decode_attention_chain_with_pdl_is_bit_equal(monkeypatch, wide):
    """Rotary + KV write of a fused qkv -> split-K paged decode (+ its reduce kernel)."""
    from gpu_common import random_paged_batch
    from kernels import elementwise_triton, paged_attention_triton

    num_q, num_kv, head_dim = 8, 2, 64
    _, kv_cache, metadata = random_paged_batch(
        [1, 1], [300, 41], num_q_heads=num_q, num_kv_heads=num_kv, head_dim=head_dim,
        block_size=16, dtype=torch.bfloat16, seed=7)
    metadata.max_seq_len = 1024      # as a graph captures it: several splits, a reduce kernel
    width = (num_q + 2 * num_kv) * head_dim

    def run(qkv, table, cache):
        cos, sin = table[:, 0:1], table[:, 1:2]
        query = elementwise_triton.apply_rotary_write_kv(qkv, num_q, num_kv, cos, sin, cache,
                                                         metadata.slot_mapping)
        out = paged_attention_triton.paged_attention(query, cache, metadata, head_dim ** -0.5)
        return out, query, cache

    inputs = [_randn(2, width, seed=40), _randn(2, 2, head_dim, seed=41), kv_cache]
    new = [[_randn(2, width, seed=50 + i), _randn(2, 2, head_dim, seed=60 + i),
            kv_cache.clone()] for i in range(3)]
    _replay_matches_eager(monkeypatch, wide, inputs, run, new)
