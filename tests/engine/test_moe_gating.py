"""Expert selection (`engine.moe.gating.select_experts`) vs transformers' own DeepSeek routers
on the same logits: the same expert sets and weights (float32, atol 1e-6), and the layer's
logical -> physical expert map."""

import pytest
import torch
from deepseek_configs import tiny_deepseek_config

from deepinfer.engine.moe.gating import RoutingConfig, select_experts


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _hf_router(variant, **overrides):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = tiny_deepseek_config(variant, **overrides)
    cls = DeepseekV3TopkRouter if variant.startswith("v3") else DeepseekV2TopkRouter
    router = cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)
    return config, router


@pytest.mark.parametrize("variant,routing", [
    ("v3_qlora_noaux_tc_yarn", dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                                    topk_group=2, norm_topk_prob=True,
                                    routed_scaling_factor=2.5)),
    ("v2_lite_greedy", dict(scoring_func="softmax", topk_method="greedy",
                            routed_scaling_factor=1.0)),
    ("v2_group_limited_yarn", dict(scoring_func="softmax", topk_method="group_limited_greedy",
                                   n_group=4, topk_group=2, routed_scaling_factor=1.5)),
])
def test_select_experts_matches_hf_router(variant, routing):
    _, router = _hf_router(variant)
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    logits, hf_weights, hf_ids = router(hidden)
    bias = getattr(router, "e_score_correction_bias", None)
    weights, ids = select_experts(logits, RoutingConfig(num_experts=8, top_k=2, **routing), bias)
    hf_weights, hf_ids = _sorted(hf_weights, hf_ids)
    weights, ids = _sorted(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)


def test_grouped_routing_stays_inside_the_best_groups():
    # 8 experts in 4 groups of 2; group 3 holds the best single expert, group 0 the best pair
    logits = torch.tensor([[2.0, 2.0, -5.0, -5.0, -5.0, -5.0, -5.0, 3.0]])
    config = RoutingConfig(num_experts=8, top_k=2, scoring_func="sigmoid",
                           topk_method="noaux_tc", n_group=4, topk_group=1)
    _, ids = select_experts(logits, config, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [0, 1]  # group 0: best top-2 sum
    config = RoutingConfig(num_experts=8, top_k=2, topk_method="group_limited_greedy",
                           n_group=4, topk_group=1)
    _, ids = select_experts(logits, config)
    assert sorted(ids[0].tolist()) == [6, 7]  # group 3: best single expert


def test_correction_bias_changes_selection_not_weights():
    logits = torch.tensor([[1.0, 0.9, 0.0, -1.0]])
    config = RoutingConfig(num_experts=4, top_k=1, scoring_func="sigmoid",
                           topk_method="noaux_tc", n_group=1, topk_group=1)
    weights, ids = select_experts(logits, config, torch.tensor([0.0, 0.0, 0.0, 2.0]))
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0]])))  # unbiased


@pytest.mark.parametrize("bad,match", [
    (dict(scoring_func="relu"), "scoring_func='relu'"),
    (dict(topk_method="random"), "topk_method='random'"),
    (dict(top_k=9), "num_experts_per_tok=9"),
    (dict(topk_method="noaux_tc", n_group=3), "n_group=3"),
    (dict(topk_method="noaux_tc", n_group=4, topk_group=5), "topk_group=5"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=2), "fewer than 2 per group"),
    (dict(top_k=None), "num_experts_per_tok=None"),
])
def test_routing_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**{"num_experts": 8, "top_k": 2, **bad})


def test_moe_layer_routes_through_logical_to_physical_map():
    """Swapping two experts' physical rows and the map gives the same output."""
    from deepinfer.engine.models.layers.moe import MoE

    routing = RoutingConfig(num_experts=4, top_k=2)
    gen = torch.Generator().manual_seed(0)
    layer = MoE(16, 8, routing, torch.float32)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen))
    hidden = torch.randn(5, 16, generator=gen)
    expected = layer(hidden)
    w13, w2 = layer.w13.data.clone(), layer.w2.data.clone()
    layer.w13.data[[0, 3]] = w13[[3, 0]]
    layer.w2.data[[0, 3]] = w2[[3, 0]]
    layer.logical_to_physical.copy_(torch.tensor([3, 1, 2, 0]))
    torch.testing.assert_close(layer(hidden), expected)
    assert torch.equal(layer.expert_weight(0, "down_proj"), w2[0])


def test_fp8_experts_track_the_bf16_layer():
    """`quantize_experts_fp8` keeps e4m3 experts with 128x128 block scales; on CPU the forward
    dequantizes them: within 5e-2 relative error of the unquantized layer (e4m3 weights)."""
    from deepinfer.engine.models.layers.moe import MoE

    routing = RoutingConfig(num_experts=4, top_k=2)
    gen = torch.Generator().manual_seed(0)
    layer = MoE(128, 128, routing, torch.float32)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    hidden = torch.randn(6, 128, generator=gen)
    expected = layer(hidden)
    layer.quantize_experts_fp8()
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w2_scale.shape == (4, 1, 1)
    got = layer(hidden)
    assert ((got - expected).norm() / expected.norm()).item() <= 5e-2


def test_fp8_experts_keep_their_scales_under_expert_parallel_placement():
    """The EP placement slices each rank's FP8 block scales with its expert slots: one rank
    with 4 redundant slots (replicas of experts 0..3 with their own scales) gives the plain
    FP8 layer's output (float32 summation order aside)."""
    from types import SimpleNamespace

    from deepinfer.engine.models.layers.moe import MoE
    from deepinfer.engine.moe.expert_parallel import EPGroup, enable_expert_parallel

    routing = RoutingConfig(num_experts=4, top_k=2)
    gen = torch.Generator().manual_seed(1)
    layer = MoE(128, 128, routing, torch.float32)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    layer.quantize_experts_fp8()
    hidden = torch.randn(9, 128, generator=gen)
    expected = layer(hidden)
    model = torch.nn.Module()
    model.layers = [SimpleNamespace(mlp=SimpleNamespace(moe=layer))]
    enable_expert_parallel(model, EPGroup(), num_redundant=4)
    assert layer.w13.shape[0] == 8 and layer.w13_scale.shape[0] == 8
    assert torch.equal(layer.w13_scale[4:], layer.w13_scale[:4])
    torch.testing.assert_close(layer(hidden), expected, rtol=1e-5, atol=1e-5)
