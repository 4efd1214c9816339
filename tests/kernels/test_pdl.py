"""Programmatic dependent launch (kernels/pdl.py): a chain of dependent decode kernels in a
CUDA graph gives bitwise the same results with PDL as without.

With PDL a kernel starts before the previous one ends; reading the previous kernel's output or
writing anything before `griddepcontrol.wait` would be a race that shows as wrong bits here. The
chain is a decode layer's kernels over 8 layers (fused norm + qkv, one-kernel rotary attention
writing the KV cache, o + residual with split-K, norm + gated gate_up, down + residual, RMSNorm;
the residual GEMMs hand their sums of squares to the next norm), each reading the one before,
replayed many times, with the Triton GEMMs and (on Hopper) the Gluon ones. On CPU (the
interpreter) PDL is off and there is nothing to compare: CUDA only.
"""

import pytest
import torch

from gpu_common import DEVICE, random_paged_batch, requires_triton
from deepinfer.kernels.backends import arrival_counters

pytestmark = [pytest.mark.gpu, requires_triton,
              pytest.mark.skipif(DEVICE != "cuda", reason="PDL needs a CUDA device")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 1024, 8, 2, 128, 2816, 8
NORM = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SWAP_AB": True}
SPLIT = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 2}


def _weights(seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [{name: w.to(DEVICE) for name, w in dict(
        qkv=rand(qkv_rows, HIDDEN), o=rand(HIDDEN, HEADS * HEAD_DIM),
        gate_up=rand(2 * INTERMEDIATE, HIDDEN), down=rand(HIDDEN, INTERMEDIATE)).items()}
        for _ in range(LAYERS)]


def _decode_layers(hidden, layers, cos, signed_sin, kv_cache, metadata, settings):
    """LAYERS decode layers on hidden [B, HIDDEN] (updated in place) with the kernel choices
    `settings`; returns the final norm."""
    from deepinfer.kernels import elementwise_triton, linear_triton
    from deepinfer.kernels.rotary_decode_triton import rotary_decode_attention

    parts = linear_triton.num_partials(HIDDEN, SPLIT)
    after_o, after_down = (torch.empty(parts, hidden.shape[0], device=hidden.device)
                           for _ in range(2))
    for i, w in enumerate(layers):
        qkv = linear_triton.linear(hidden, w["qkv"], config=NORM, norm_eps=1e-5,
                                   sum_squares=after_down if i else None, settings=settings)
        attn = rotary_decode_attention(qkv, HEADS, cos, signed_sin, kv_cache, metadata,
                                       HEAD_DIM ** -0.5, settings=settings)
        linear_triton.linear(attn.view(hidden.shape[0], -1), w["o"], config=SPLIT,
                             residual=hidden, sum_squares_out=after_o, settings=settings)
        act = linear_triton.linear(hidden, w["gate_up"], config=NORM, norm_eps=1e-5,
                                   gated=True, sum_squares=after_o, settings=settings)
        linear_triton.linear(act, w["down"], config=SPLIT, residual=hidden,
                             sum_squares_out=after_down, settings=settings)
    weight = torch.ones(HIDDEN, dtype=hidden.dtype, device=hidden.device)
    return elementwise_triton.rms_norm(hidden, weight, 1e-5, settings=settings)


def _run(pdl_enabled, release_early, monkeypatch, replays=6, gluon=False):
    """Per replay (new hidden input): (final norm, KV cache) after a graph of the chain; with
    `gluon`, its GEMMs on `kernels/linear_gluon.py` (all but the first norm)."""
    from deepinfer.kernels.settings import KernelConfig

    settings = KernelConfig(pdl=pdl_enabled, pdl_release_early=release_early,
                            gluon_block_m=frozenset({16, 32, 64}) if gluon else frozenset())
    gluon_launches = []
    if gluon:   # count the Gluon kernels' launches: the chain must run on them, not fall back
        from deepinfer.kernels import linear_gluon

        monkeypatch.setattr(linear_gluon, "launch",
                            lambda *a, _launch=linear_gluon.launch, **k:
                            gluon_launches.append(1) or _launch(*a, **k))
    layers = _weights(seed=0)
    _, kv_cache, metadata = random_paged_batch(
        [1] * 4, [300, 17, 64, 129], num_q_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, block_size=16, dtype=torch.bfloat16, seed=1)
    gen = torch.Generator().manual_seed(2)
    angles = torch.rand(4, 1, HEAD_DIM // 2, generator=gen) * 6.28
    cos = angles.cos().repeat(1, 1, 2).to(torch.bfloat16).to(DEVICE)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], -1).to(torch.bfloat16).to(DEVICE)
    hidden = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    initial_cache = kv_cache.clone()
    _decode_layers(hidden, layers, cos, signed_sin, kv_cache, metadata, settings)   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_layers(hidden, layers, cos, signed_sin, kv_cache, metadata, settings)
    results = []
    for seed in range(replays):
        kv_cache.copy_(initial_cache)
        hidden.copy_(torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(10 + seed))
                     .to(torch.bfloat16))
        graph.replay()
        results.append((out.clone(), kv_cache.clone()))
    torch.cuda.synchronize()
    assert not arrival_counters(hidden.device).any()
    assert bool(gluon_launches) == gluon
    return results


_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
_GLUON = pytest.mark.skipif(not _HOPPER, reason="the Gluon GEMM runs on Hopper")


@pytest.mark.parametrize("release_early,gluon", [
    (frozenset(), False), (frozenset({"attention"}), False),
    (frozenset({"linear", "attention"}), False),
    # the Gluon GEMM requests its weights before its wait (and may release right after it)
    pytest.param(frozenset({"attention"}), True, marks=_GLUON),
    pytest.param(frozenset({"attention", "linear_gluon"}), True, marks=_GLUON),
    # the committed release points: gate_up, o and down early, qkv after its K loop
    pytest.param(frozenset({"attention", "linear_gluon gated", "linear_gluon residual"}), True,
                 marks=_GLUON),
], ids=["after_loops", "attention_early", "all_early", "gluon_after_loop", "gluon_early",
        "gluon_by_role"])
def test_pdl_chain_in_a_cuda_graph_is_bitwise_the_chain_without_pdl(release_early, gluon,
                                                                     monkeypatch):
    expected = _run(False, frozenset(), monkeypatch, gluon=gluon)
    got = _run(True, release_early, monkeypatch, gluon=gluon)
    for (out, cache), (want_out, want_cache) in zip(got, expected):
        assert torch.isfinite(out.float()).all()
        assert torch.equal(out, want_out)
        assert torch.equal(cache, want_cache)
    assert not torch.equal(got[0][0], got[1][0])   # the replays saw different inputs


def test_pdl_is_off_off_hopper_and_in_the_interpreter(monkeypatch):
    from deepinfer.kernels import pdl

    expected = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.supported(torch.device("cuda")) == expected
    assert not pdl.supported(torch.device("cpu"))
    from deepinfer.kernels.settings import KernelConfig

    assert pdl.launch_options(torch.device("cuda"), KernelConfig(pdl=False)) == {}
