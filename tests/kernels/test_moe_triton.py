"""Triton fused MoE (`kernels/moe_triton.py`) vs the loop-over-experts reference.

Tolerances: float32 (full-precision dots) atol 1e-5 / rtol 1e-5 against the float32 reference;
bfloat16 relative error (||out - ref|| / ||ref||) <= 1e-2 against the reference run in float32 on
the same bf16 inputs (the kernel rounds SiLU(gate) * up once to bf16 before the down GEMM).
Covers ragged token counts, experts no token picked, one expert picked by every token, several
row tiles per expert, the alignment layout itself, determinism (bitwise, run to run) and, on
CUDA, a graph capture of routing + experts replayed on new inputs. Runs on CUDA, or on CPU under
TRITON_INTERPRET=1 (small shapes).
"""

import pytest
import torch

from gpu_common import DEVICE, relative_error, requires_triton
from deepinfer.engine.moe.gating import RoutingConfig, route_hidden, select_experts
from deepinfer.kernels.moe import moe_experts
from deepinfer.kernels.settings import KernelConfig, MoETile

pytestmark = [pytest.mark.gpu, requires_triton]
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def make_moe(num_tokens, num_experts, top_k, hidden=64, inter=48, dtype=torch.float32, seed=0,
             scores=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    if scores is None:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
    weights, ids = scores.topk(top_k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def check(args, settings=KernelConfig()):
    got = moe_experts(*args, backend="triton", settings=settings)
    ref_args = [a.float() if a.is_floating_point() else a for a in args]
    expected = moe_experts(*[a.cpu() for a in ref_args], backend="reference")
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    if args[0].dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    else:
        assert relative_error(got, expected) <= 1e-2
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (7, 8, 3), (33, 16, 4),
                                                          (5, 64, 6), (3, 4, 4)])
def test_matches_reference(num_tokens, num_experts, top_k, dtype):
    check(make_moe(num_tokens, num_experts, top_k, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 64, 6), (1, 8, 8), (5, 8, 3),
                                                          (33, 16, 4)])
def test_pair_tiles_without_alignment_match_reference(num_tokens, num_experts, top_k, dtype):
    """`moe_pair_tiles_max_tokens`: each (token, k) pair its own row tile, no alignment kernel
    (the default at one token; forced here up to 64 tokens, where experts picked by several
    tokens are read once per pair): same tolerances as the aligned path."""
    settings = KernelConfig(moe_pair_tiles_max_tokens=64)
    check(make_moe(num_tokens, num_experts, top_k, dtype=dtype, seed=13), settings)
    scores = torch.rand(num_tokens, num_experts, generator=torch.Generator().manual_seed(14))
    scores[:, 1] = 2.0   # expert 1 picked by every token
    check(make_moe(num_tokens, num_experts, top_k, dtype=dtype, scores=scores), settings)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,pair_tiles_max_tokens", [(1, 1), (1, 0), (9, 0), (70, 0)])
def test_swapped_operands_match_reference(num_tokens, pair_tiles_max_tokens, dtype):
    """`MoETile.swap_ab` (weight tile on the MMA's M side, accumulators transposed): pair tiles
    and aligned tiles, 64-wide column tiles over 48 gate_up / 64 down columns (a partial
    column tile), expert 2 picked by every token (several row tiles of one expert at 70)."""
    scores = torch.rand(num_tokens, 8, generator=torch.Generator().manual_seed(21))
    scores[:, 2] = 2.0
    tile = MoETile(1 << 30, 16, 64, 64, 32, swap_ab=True)
    settings = KernelConfig(moe_tiles=(tile,), moe_pair_tile=tile,
                            moe_pair_tiles_max_tokens=pair_tiles_max_tokens)
    check(make_moe(num_tokens, 8, 3, dtype=dtype, scores=scores), settings)


def test_experts_no_token_picked():
    scores = torch.rand(9, 16, generator=torch.Generator().manual_seed(3))
    scores[:, 4:] = -1.0  # only experts 0..3 can be picked: 12 experts get no token
    check(make_moe(9, 16, 2, scores=scores))


@pytest.mark.parametrize("tile_rows,group_m", [(16, 0), (32, 0), (64, 0), (16, 2), (32, 3)])
def test_one_expert_picked_by_every_token(tile_rows, group_m):
    """Expert 5 takes all 70 tokens: several row tiles of one expert (and a partial last one),
    in either launch order (group_m 0: all row tiles per column tile; 2, 3: grouped, the last
    group partial)."""
    scores = torch.rand(70, 8, generator=torch.Generator().manual_seed(4))
    scores[:, 5] = 2.0
    settings = KernelConfig(moe_tiles=(MoETile(1 << 30, tile_rows, 32, 32, 32,
                                               group_m=group_m),))
    check(make_moe(70, 8, 3, scores=scores), settings)


@pytest.mark.parametrize("one_program_max_pairs", [0, 256], ids=["rank+layout", "one_program"])
def test_alignment_layout(one_program_max_pairs):
    from deepinfer.kernels.moe_triton import align

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]], device=DEVICE)
    sorted_pairs, block_expert, num_blocks = align(ids, 6, 16, KernelConfig(
        moe_align_one_program_max_pairs=one_program_max_pairs))
    assert num_blocks == 7  # cdiv(10 pairs + min(6 experts, 10 pairs) * 15, 16): static
    sorted_pairs, block_expert = sorted_pairs.cpu().view(num_blocks, 16), block_expert.cpu()
    assert block_expert.tolist() == [0, 1, 2, 3, -1, -1, -1]  # 4 and 5 got no pair
    flat = ids.cpu().reshape(-1)
    for block, expert in enumerate(block_expert.tolist()):
        real = [p for p in sorted_pairs[block].tolist() if p < 10]
        if expert >= 0:
            assert sorted(real) == sorted(i for i in range(10) if flat[i] == expert)
        assert all(p == 10 for p in sorted_pairs[block].tolist() if p not in real)


@pytest.mark.parametrize("num_pairs", [6, 246, 510, 3000])
def test_one_program_and_parallel_alignment_agree(num_pairs):
    """The one-program alignment (pairs of an expert in pair order; up to its 512-pair limit)
    and the atomic rank + parallel layout (several layout programs at 3,000 pairs) give the
    same tiles' experts and the same set of pairs per expert; above the limit the parallel
    layout alone holds every pair once, each in a tile of its expert."""
    from deepinfer.kernels.moe_triton import align

    gen = torch.Generator().manual_seed(num_pairs)
    ids = torch.randint(0, 64, (num_pairs // 6, 6), generator=gen)
    ids[0] = 7   # one expert several times
    ids = ids.to(DEVICE)
    parallel = align(ids, 64, 16, KernelConfig(moe_align_one_program_max_pairs=0))
    if num_pairs > 512:
        flat = ids.reshape(-1).cpu()
        pairs = parallel[0].tolist()
        assert sorted(p for p in pairs if p < num_pairs) == list(range(num_pairs))
        for block, expert in enumerate(parallel[1].tolist()):
            tile = [p for p in pairs[block * 16:(block + 1) * 16] if p < num_pairs]
            assert all(flat[p] == expert for p in tile) and (expert >= 0 or not tile)
        return
    one = align(ids, 64, 16, KernelConfig(moe_align_one_program_max_pairs=512))
    assert one[2] == parallel[2]
    assert torch.equal(one[1], parallel[1])
    flat = ids.reshape(-1).cpu()
    for block, expert in enumerate(one[1].tolist()):
        rows = [pairs[block * 16:(block + 1) * 16].tolist() for pairs in (one[0], parallel[0])]
        assert sorted(rows[0]) == sorted(rows[1])
        if expert >= 0:
            assert all(flat[p] == expert for p in rows[0] if p < num_pairs)
    # one program: an expert's pairs in pair order
    real = [p for p in one[0].tolist() if p < num_pairs]
    assert sorted(real) == list(range(num_pairs))
    for expert in range(64):
        mine = [p for p in real if flat[p] == expert]
        assert mine == sorted(mine)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 70])
def test_shared_output_added_in_the_combine(num_tokens, dtype):
    """`shared_output` is added to the routed sum: float32 within 1e-5 of reference + shared;
    bf16 within 1e-2 relative."""
    args = make_moe(num_tokens, 16, 4, dtype=dtype, seed=11)
    shared = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(12))
    got = moe_experts(*args, backend="triton", shared_output=shared.to(DEVICE, dtype))
    ref_args = [a.float().cpu() if a.is_floating_point() else a.cpu() for a in args]
    expected = moe_experts(*ref_args, backend="reference") + shared.to(dtype).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    else:
        assert relative_error(got, expected) <= 1e-2
    if DEVICE == "cuda":   # written on another stream: the combine waits for the event
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 22)   # ~ms of spinning: the shared output comes late
            late = (shared.to(DEVICE, dtype) * 2.0) - shared.to(DEVICE, dtype)
            ready = side.record_event()
        got_late = moe_experts(*args, backend="triton", shared_output=late, shared_ready=ready)
        assert torch.equal(got_late, got)
    # the torch backend adds it after its own sum
    torch_out = moe_experts(*ref_args, backend="torch", shared_output=shared.to(dtype).float())
    torch.testing.assert_close(torch_out, expected, atol=1e-5, rtol=1e-5)


def test_deterministic_run_to_run():
    args = make_moe(40, 8, 3, seed=5)
    first = moe_experts(*args, backend="triton")
    for _ in range(3):
        assert torch.equal(moe_experts(*args, backend="triton"), first)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_routing_and_experts_replay_in_a_cuda_graph(num_tokens):
    """noaux_tc + grouped top-k + routed_scaling_factor routing (fused with the router GEMM
    at 1 and 8 tokens) then the fused experts, captured
    once and replayed on new hidden states: equal to the eager call on those states."""
    routing = RoutingConfig(num_experts=16, top_k=4, scoring_func="sigmoid",
                            topk_method="noaux_tc", n_group=4, topk_group=2,
                            norm_topk_prob=True, routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(6)
    gate = torch.randn(16, 64, generator=gen).to(DEVICE)
    bias = (torch.rand(16, generator=gen) * 0.1).to(DEVICE)
    _, w13, w2, _, _ = make_moe(num_tokens, 16, 4, dtype=torch.bfloat16)
    hidden = torch.randn(num_tokens, 64, device=DEVICE, dtype=torch.bfloat16)

    def forward():   # up to 8 tokens: logits and routing in one launch (`route_hidden`)
        weights, ids = route_hidden(hidden, gate, routing, bias,
                                    logical_to_physical=torch.arange(16, device=DEVICE),
                                    settings=KernelConfig(moe_fused_router_max_rows=8))
        return moe_experts(hidden, w13, w2, weights, ids, backend="triton")

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for seed in range(3):
        hidden.copy_(torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(seed))
                     .to(DEVICE, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, forward())


ROUTINGS = {
    "v2_lite_greedy_softmax": dict(num_experts=64, top_k=6),
    "v2_group_limited": dict(num_experts=160, top_k=6, topk_method="group_limited_greedy",
                             n_group=8, topk_group=3, routed_scaling_factor=16.0),
    "v3_noaux_tc_grouped": dict(num_experts=64, top_k=8, scoring_func="sigmoid",
                                topk_method="noaux_tc", n_group=8, topk_group=4,
                                norm_topk_prob=True, routed_scaling_factor=2.5),
    "sigmoid_greedy_k1": dict(num_experts=16, top_k=1, scoring_func="sigmoid"),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_fused_routing_matches_torch_routing(name):
    """The one-launch Triton router vs the torch ops: the same expert set per token and the
    same weights (atol 1e-6; float32 softmax / sigmoid in both), ids through a permuted
    logical -> physical map."""
    routing = RoutingConfig(**ROUTINGS[name])
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(37, routing.num_experts, generator=gen) * 2).to(DEVICE)
    bias = (torch.rand(routing.num_experts, generator=gen) * 0.5).to(DEVICE)
    mapping = torch.randperm(routing.num_experts, generator=gen).to(DEVICE)
    w_ref, i_ref = select_experts(logits, routing, bias, logical_to_physical=mapping,
                                  backend="torch")
    w_got, i_got = select_experts(logits, routing, bias, logical_to_physical=mapping,
                                  backend="triton")
    assert i_got.shape == i_ref.shape and i_got.dtype == torch.int64
    order_ref, order_got = i_ref.argsort(dim=1), i_got.argsort(dim=1)
    assert torch.equal(i_got.gather(1, order_got), i_ref.gather(1, order_ref))
    torch.testing.assert_close(w_got.gather(1, order_got), w_ref.gather(1, order_ref),
                               atol=1e-6, rtol=1e-5)


def fused_router(hidden, gate, routing, bias, mapping):
    from deepinfer.kernels.moe_routing_triton import route_hidden as fused

    return fused(hidden, gate, top_k=routing.top_k, scoring_func=routing.scoring_func,
                 topk_method=routing.topk_method, n_group=routing.n_group,
                 topk_group=routing.topk_group, norm_topk_prob=routing.norm_topk_prob,
                 routed_scaling_factor=routing.routed_scaling_factor,
                 e_score_correction_bias=bias, logical_to_physical=mapping)


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_router_logits_and_routing_in_one_launch(name, num_tokens):
    """`moe_routing_triton.route_hidden` (logits + routing in one kernel) vs the float32 GEMM then
    the torch routing: the same expert set per token, weights within atol 1e-5 (float32
    logits summed in another order: differences ~1e-7); bf16 hidden of 7168 (V3's width, 28
    chunks) and 2048, a bf16 gate weight read as float32; logits scaled so no near-ties."""
    routing = RoutingConfig(**ROUTINGS[name])
    hidden_size = 7168 if routing.num_experts >= 160 else 2048
    gen = torch.Generator().manual_seed(9 + num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(torch.bfloat16).to(DEVICE)
    gate = (torch.randn(routing.num_experts, hidden_size, generator=gen)
            * hidden_size ** -0.5 * 3).to(torch.bfloat16).float().to(DEVICE)
    bias = (torch.rand(routing.num_experts, generator=gen) * 0.5).to(DEVICE)
    mapping = torch.randperm(routing.num_experts, generator=gen).to(DEVICE)
    logits = hidden.float().cpu() @ gate.cpu().T
    w_ref, i_ref = select_experts(logits, routing, bias.cpu(),
                                  logical_to_physical=mapping.cpu(), backend="torch")
    for weight in (gate, gate.to(torch.bfloat16)):
        w_got, i_got = fused_router(hidden, weight, routing, bias, mapping)
        assert i_got.shape == i_ref.shape and i_got.dtype == torch.int64
        order_ref, order_got = i_ref.argsort(dim=1), i_got.cpu().argsort(dim=1)
        assert torch.equal(i_got.cpu().gather(1, order_got), i_ref.gather(1, order_ref))
        torch.testing.assert_close(w_got.cpu().gather(1, order_got), w_ref.gather(1, order_ref),
                                   atol=1e-5, rtol=1e-4)
        # deterministic: the same bits on a second call (the counter was reset)
        w_again, i_again = fused_router(hidden, weight, routing, bias, mapping)
        assert torch.equal(w_again, w_got) and torch.equal(i_again, i_got)


class _FakeDeepGemm:
    """Stands in for an installed `deep_gemm` (it does not build here): its contiguous grouped
    GEMM computed with torch, honouring m_indices (-1 rows skipped), and a call counter."""

    def __init__(self):
        self.calls = 0

    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return 128

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, m_indices):
        self.calls += 1
        assert a.shape[0] % 128 == 0 and m_indices.dtype == torch.int32
        d.zero_()
        for row, expert in enumerate(m_indices.tolist()):
            if expert >= 0:
                d[row] = (b[expert].float() @ a[row].float()).to(d.dtype)


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    import sys

    from deepinfer.kernels import moe_deep_gemm

    fake = _FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(moe_deep_gemm, "available", lambda: True)
    return fake


def test_deep_gemm_backend_layout_matches_reference(fake_deep_gemm):
    """Our alignment fed to DeepGEMM's contiguous layout (128-row runs, -1 padding rows)."""
    args = make_moe(21, 8, 3, dtype=torch.float32)
    got = moe_experts(*args, backend="deep_gemm")
    expected = moe_experts(*[a.cpu() for a in args], backend="reference")
    assert fake_deep_gemm.calls == 2
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_auto_picks_deep_gemm_only_for_many_rows_per_expert(fake_deep_gemm):
    from deepinfer.kernels.moe import resolve_backend

    if resolve_backend("auto", torch.device(DEVICE)) != "triton":
        pytest.skip("auto is not the Triton backend here (CPU interpreter run)")
    settings = KernelConfig(moe_deep_gemm_min_rows=4)
    moe_experts(*make_moe(5, 8, 2, dtype=torch.bfloat16), settings=settings)  # 1.25 rows/expert
    assert fake_deep_gemm.calls == 0
    moe_experts(*make_moe(40, 8, 2, dtype=torch.bfloat16), settings=settings)  # 10 rows/expert
    assert fake_deep_gemm.calls == 2
    w13, s13, w2, s2 = _fp8_experts(8, 128, 256)   # FP8 experts keep the Triton FP8 GEMMs
    weights, ids = torch.rand(40, 8, device=DEVICE).topk(2, dim=-1)
    moe_experts(torch.randn(40, 256, device=DEVICE, dtype=torch.bfloat16), w13, w2, weights,
                ids, settings=settings, w13_scale=s13, w2_scale=s2)
    assert fake_deep_gemm.calls == 2


def _fp8_experts(num_experts, inter, hidden, seed=9):
    """Random FP8 expert weights with 128x128 block scales (DeepSeek-V3's layout)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        scale = torch.rand(num_experts, rows // 128, cols // 128, generator=gen) * 0.01 + 0.002
        weight = (torch.randn(num_experts, rows, cols, generator=gen) * 50).clamp(-448, 448)
        out += [weight.to(torch.float8_e4m3fn).to(DEVICE), scale.to(DEVICE)]
    return out


def _fp8_recipe(hidden, w13, w2, weights, ids):
    """The FP8 experts' arithmetic in torch: activations quantized to e4m3 per row and
    128-channel block (scale = amax / 448), weights dequantized, float32 products."""
    import torch.nn.functional as F

    def quantize(x):
        blocks = x.reshape(x.shape[0], -1, 128)
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
        return ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                * scale).reshape(x.shape)

    out = torch.zeros_like(hidden)
    inter = w13.shape[1] // 2
    for token in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[token, k])
            gate_up = quantize(hidden[token:token + 1]) @ w13[e].T
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out[token] += weights[token, k] * (quantize(act) @ w2[e].T)[0]
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_fp8_experts_follow_the_recipe(num_tokens):
    """FP8 weights + 128x128 block scales (DeepSeek-V3 layout), activations quantized per row
    and 128-channel block inside the GEMMs (DeepGEMM's recipe). The recipe itself (torch) is
    within 8e-2 relative error of the float32 reference on the dequantized weights (e4m3 has 3
    mantissa bits); the kernel equals the recipe within 2e-3 (float32 sums in another order;
    a rare one-ulp e4m3 rounding flip). Triton's interpreter rounds some values at a binade
    boundary to the wrong e4m3 neighbour (-124 -> -64), so the kernel check needs CUDA."""
    from deepinfer.kernels.moe import dequantize_blocks

    w13, s13, w2, s2 = _fp8_experts(4, 128, 256)
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(num_tokens, 256, generator=gen)
    weights, ids = torch.rand(num_tokens, 4, generator=gen).topk(2, dim=-1)
    w13_f = dequantize_blocks(w13, s13, torch.float32).cpu()
    w2_f = dequantize_blocks(w2, s2, torch.float32).cpu()
    expected = moe_experts(hidden, w13_f, w2_f, weights, ids, backend="reference")
    recipe = _fp8_recipe(hidden, w13_f, w2_f, weights, ids)
    assert relative_error(recipe, expected) <= 8e-2
    # the torch backend takes the same FP8 arguments by dequantizing first
    dequantized = moe_experts(hidden, w13.cpu(), w2.cpu(), weights, ids, backend="torch",
                              w13_scale=s13.cpu(), w2_scale=s2.cpu())
    torch.testing.assert_close(dequantized, expected, atol=1e-4, rtol=1e-4)
    if DEVICE != "cuda":
        pytest.skip("the interpreter's e4m3 rounding differs from the hardware's")
    got = moe_experts(hidden.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE),
                      backend="triton", w13_scale=s13, w2_scale=s2)
    assert relative_error(got, recipe) <= 2e-3


@pytest.mark.parametrize("num_tokens", [3, 40, 700])
def test_fp8_activations_quantized_once_equal_the_in_loop_quantization(num_tokens):
    """`moe_fp8_quantize_once_pairs`: quantizing each GEMM's activations once
    (`quantize_activation`) gives the codes and scales the K loops compute themselves, so the
    same output (float32 and bf16 hidden; 700 tokens reach the 128-row prefill tile; the
    float32 sums run in the same order, so at most a float32 / bf16 rounding flip)."""
    if DEVICE != "cuda":
        pytest.skip("the interpreter's e4m3 rounding differs from the hardware's")
    w13, s13, w2, s2 = _fp8_experts(4, 128, 256)
    gen = torch.Generator().manual_seed(12)
    weights, ids = torch.rand(num_tokens, 4, generator=gen).topk(2, dim=-1)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(num_tokens, 256, generator=gen).to(DEVICE, dtype)
        args = (hidden, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
        in_loop = moe_experts(*args, backend="triton", w13_scale=s13, w2_scale=s2,
                              settings=KernelConfig(moe_fp8_quantize_once_pairs=1 << 30))
        once = moe_experts(*args, backend="triton", w13_scale=s13, w2_scale=s2,
                           settings=KernelConfig(moe_fp8_quantize_once_pairs=1))
        tolerance = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(once, in_loop, rtol=tolerance, atol=1e-6)
