"""kernels/fused_linear.py: folding an RMSNorm weight into the next linear, the unfused path of
each fused op (any device) and, on CUDA, the fused kernels chosen by the device's config file
against the unfused ops (bf16: relative error < 1e-2, float64 references)."""

import json

import pytest
import torch
import torch.nn.functional as F
from gpu_common import DEVICE, relative_error, requires_triton

from deepinfer.kernels import fused_linear
from deepinfer.kernels.fused_linear import add_norm_linear, fold_norm_weight, linear_add

EPS = 1e-5


def _randn(*shape, dtype=torch.float32, seed, scale=1.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _norm(x, g=None):
    x64 = x.double()
    out = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    return out if g is None else out * g.double()


def test_folded_norm_weight_gives_the_same_function_unfused():
    """CPU float32: after the fold, add_norm_linear (pending added into the stream first) is
    linear(rms_norm(residual + pending) * g); the norm weight is left all ones."""
    g = _randn(64, seed=1) + 1.0
    weight = _randn(48, 64, seed=2, scale=0.125)
    expected_weight = weight.double() * g.double()
    norm_weight = g.clone()
    fold_norm_weight(norm_weight, weight)
    assert torch.equal(norm_weight, torch.ones(64))
    assert relative_error(weight, expected_weight) < 1e-6
    pending, residual = _randn(3, 64, seed=3), _randn(3, 64, seed=4)
    stream = pending.double() + residual.double()
    out, new_residual = add_norm_linear(pending, residual, norm_weight, EPS, weight)
    assert relative_error(new_residual, stream) < 1e-6
    expected = F.linear(_norm(stream, g), (expected_weight / g.double()))
    assert relative_error(out, expected) < 1e-5
    gated, _ = add_norm_linear(None, new_residual, norm_weight, EPS, weight, gated=True)
    gate, up = F.linear(_norm(stream, g), expected_weight / g.double()).chunk(2, dim=-1)
    assert relative_error(gated, F.silu(gate) * up) < 1e-5


def test_fold_refuses_an_fp8_weight():
    """A float8 weight's value is codes x block scales: folding g into the codes would be
    wrong, so the fold refuses and leaves both tensors as they were."""
    codes = _randn(8, 16, seed=16).to(torch.float8_e4m3fn)
    norm_weight = _randn(16, seed=17) + 1.0
    before = (codes.clone(), norm_weight.clone())
    with pytest.raises(ValueError, match="FP8"):
        fold_norm_weight(norm_weight, codes)
    assert torch.equal(codes.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(norm_weight, before[1])


def test_unfused_norm_linear_takes_added_rows_as_already_added():
    """An AddedRows pending (a fused residual GEMM's) on the unfused path: the stream is
    normed as it is, the partials are not needed."""
    residual, weight = _randn(3, 64, seed=14), _randn(48, 64, seed=15, scale=0.125)
    partials = torch.full((2, 3), float("nan"))
    out, same = add_norm_linear(fused_linear.AddedRows(partials), residual, torch.ones(64), EPS,
                                weight)
    assert same is residual
    assert relative_error(out, F.linear(_norm(residual), weight.double())) < 1e-5


def test_unfused_linear_add_leaves_the_add_pending():
    x, weight, residual = _randn(2, 32, seed=5), _randn(16, 32, seed=6), _randn(2, 16, seed=7)
    before = residual.clone()
    pending, same = linear_add(x, weight, None, residual)
    assert same is residual and torch.equal(residual, before)
    assert relative_error(pending, F.linear(x.double(), weight.double())) < 1e-6


@pytest.mark.gpu
@requires_triton
@pytest.mark.skipif(DEVICE != "cuda", reason="the fused kernels are chosen on CUDA only")
def test_fused_kernels_run_where_the_config_file_says_and_match_the_unfused_ops(
        monkeypatch, tmp_path):
    """A two-boundary chain (o -> gate_up, down -> qkv in miniature) fused against unfused:
    the fused linear_add adds into the residual in place and returns AddedRows (the rows' sums
    of squares, which the next norm reads), or None with the handoff off."""
    from deepinfer.kernels import backends
    from deepinfer.kernels.settings import KernelConfig

    small = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    shapes = {"residual": [(64, 96), (64, 128)], "norm_gated": [(256, 64)], "norm": [(96, 64)]}
    entries = [{"fusion": fusion, "block_m": 16, "out_features": n, "in_features": k,
                "config": dict(small, SPLIT_K=2 if fusion == "residual" else 1),
                "fused_faster": True} for fusion, pairs in shapes.items() for n, k in pairs]
    monkeypatch.setattr(backends, "CONFIG_DIR", tmp_path)
    backends.device_config_path(fused_linear.CONFIG_KIND, torch.cuda.get_device_name()
                                ).write_text(json.dumps({"entries": entries}))
    backends.tuned_table.cache_clear()
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    w_o, w_gu = _randn(64, 96, seed=8, scale=0.1, **bf16), _randn(256, 64, seed=9, **bf16)
    w_down, w_qkv = _randn(64, 128, seed=10, scale=0.1, **bf16), _randn(96, 64, seed=11, **bf16)
    ones = torch.ones(64, **bf16)

    def chain(attn_out, stream, settings=KernelConfig()):
        pending, stream = linear_add(attn_out, w_o, None, stream, settings=settings)
        act, stream = add_norm_linear(pending, stream, ones, EPS, w_gu, gated=True,
                                      settings=settings)
        pending, stream = linear_add(act, w_down, None, stream, settings=settings)
        qkv, stream = add_norm_linear(pending, stream, ones, EPS, w_qkv, settings=settings)
        return pending, stream, qkv

    try:
        attn_out, stream = _randn(5, 96, seed=12, **bf16), _randn(5, 64, seed=13, **bf16)
        assert fused_linear.fused_config("norm_gated", stream, w_gu) is not None
        fused_pending, fused_stream, fused_qkv = chain(attn_out, stream.clone())
        no_handoff_pending, no_handoff_stream, no_handoff_qkv = chain(
            attn_out, stream.clone(), KernelConfig(sum_squares_handoff=False))
        pending, unfused_stream, qkv = chain(attn_out, stream.clone(),
                                             KernelConfig(fused_linears=False))
    finally:
        backends.tuned_table.cache_clear()
    assert isinstance(fused_pending, fused_linear.AddedRows) and no_handoff_pending is None
    assert isinstance(pending, torch.Tensor)
    # the handoff changes only how the norms sum their squares
    assert relative_error(fused_stream, no_handoff_stream) < 1e-3
    assert relative_error(fused_qkv, no_handoff_qkv) < 1e-2
    assert relative_error(fused_stream, unfused_stream) < 1e-2   # both hold every add
    assert relative_error(fused_qkv, qkv) < 1e-2


# the sweep's launch configs that V2-Lite's shapes pick from: SWAP_AB split-K 8 (the 2048-wide
# outputs' winner in gemv_sweep), SWAP_AB one split, and the plain x W^T tile
V2_LITE_CONFIGS = {
    "swap_split_k": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4,
                     "SPLIT_K": 8, "SWAP_AB": True},
    "swap": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 8, "SPLIT_K": 1,
             "SWAP_AB": True},
    "plain": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 1},
}


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("label", ["attn_to_moe", "moe_to_attn"])
@pytest.mark.parametrize("residual_config", ["swap_split_k", "plain"])
def test_sweep_chains_at_deepseek_v2_lite_shapes(label, residual_config):
    """`benchmarks/fused_linear_sweep.py --model deepseek-v2-lite`'s two chains at V2-Lite's
    real shapes and one row (o_proj 2048 x 2048 -> RMSNorm; shared-experts down 2048 x 2816 ->
    q + kv_a 3648 x 2048 with the norm): fused equals unfused (float32 1e-5 on CPU through
    TRITON_INTERPRET=1, float64 references' tolerance for bf16 1e-2 on CUDA)."""
    from benchmarks.fused_linear_sweep import BOUNDARIES, fused_chain, unfused_boundary
    from benchmarks.gemv_sweep import SHAPES

    boundary = BOUNDARIES[label]
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    names = [boundary.first] + ([boundary.second] if boundary.second else [])
    weights = [_randn(*SHAPES[name], dtype=dtype, seed=20 + i, scale=SHAPES[name][1] ** -0.5,
                      device=DEVICE) for i, name in enumerate(names)]
    hidden = SHAPES[boundary.first][0]
    x = _randn(1, SHAPES[boundary.first][1], dtype=dtype, seed=23, device=DEVICE)
    residual = _randn(1, hidden, dtype=dtype, seed=24, device=DEVICE)
    ones = torch.ones(hidden, dtype=dtype, device=DEVICE)
    configs = [V2_LITE_CONFIGS[residual_config], V2_LITE_CONFIGS["swap"]]
    expected = unfused_boundary(boundary, x, weights, residual.clone(), ones)
    got = fused_chain(boundary, x, weights, residual.clone(), configs, ones)
    assert got.shape == (1, SHAPES[names[-1]][0])
    assert relative_error(got, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_a_v2_lite_sweep_is_merged_into_the_llama_entries(monkeypatch, tmp_path):
    """`fused_linear_sweep.py --model deepseek-v2-lite --write-configs` on a device whose file
    holds Llama's entries (the H200 file's Llama entries, copied): those stay as they were, the
    V2-Lite ones join them, each bucket's boundaries in `BOUNDARIES` order, residual GEMM
    before norm GEMM."""
    from benchmarks.fused_linear_sweep import MODELS, config_key
    from deepinfer.kernels import backends

    device = "NVIDIA H200"
    llama = [e for e in json.loads(backends.device_config_path(fused_linear.CONFIG_KIND, device)
                                   .read_text())["entries"]
             if not e["shape"].startswith("v2lite")]   # the file's Llama-3-8B entries
    monkeypatch.setattr(backends, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: device)
    backends.write_device_config(fused_linear.CONFIG_KIND, llama, "the H200's file")
    swept = [{"block_m": bucket, "boundary": label, "shape": shape, "fused_faster": True}
             for bucket in (64, 16) for label, boundary in MODELS["deepseek-v2-lite"].items()
             for shape in filter(None, (boundary.second, boundary.first))]
    path = backends.update_device_config(fused_linear.CONFIG_KIND, swept, "a V2-Lite sweep",
                                         key=config_key)
    merged = json.loads(path.read_text())["entries"]
    assert [e for e in merged if e in llama] == llama and len(merged) == len(llama) + 6
    assert [(e["block_m"], e["shape"]) for e in merged if e not in llama] == [
        (16, "v2lite_o"), (16, "v2lite_shared_down"), (16, "v2lite_q_kv_a"),
        (64, "v2lite_o"), (64, "v2lite_shared_down"), (64, "v2lite_q_kv_a")]
    assert [e["shape"] for e in merged[:6]] == ["o", "gate_up", "down", "qkv", "v2lite_o",
                                                "v2lite_shared_down"]
