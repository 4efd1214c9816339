"""Fused MoE routing in Triton: router logits -> scores -> (grouped) top-k -> weights, one
program per token, one launch per layer (the torch ops take ~8 per layer at decode).

Same arithmetic as `engine.moe.gating.select_experts` (transformers' DeepseekV2/V3 routers):
scores = softmax or sigmoid of the float32 logits; "noaux_tc" adds the correction bias for the
choice only and ranks groups by the sum of their two best biased scores, "group_limited_greedy"
ranks groups by their best score and zeroes the experts outside the `topk_group` best groups;
then top-k by iterated argmax (ties go to the lower expert id), weights renormalised with
`norm_topk_prob`, times `routed_scaling_factor`; ids mapped logical -> physical in the same
program. No host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.settings import DEFAULT, KernelConfig

METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, map_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  scaling, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, METHOD: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr,
                  K_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_and_release(PDL, True)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0)
    choice = tl.where(valid, choice, -float("inf"))
    if METHOD != 0:
        per_group = num_experts // N_GROUP
        group = offs // per_group
        g_offs = tl.arange(0, G_PAD)
        group_scores = tl.full([G_PAD], -float("inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = valid & (group == g)
            member = tl.where(in_g, choice, -float("inf"))
            best = tl.max(member, axis=0)
            if METHOD == 2:   # the sum of the group's two best (biased) scores
                first = tl.argmax(member, axis=0)
                best = best + tl.max(tl.where(offs == first, -float("inf"), member), axis=0)
            group_scores = tl.where(g_offs == g, best, group_scores)
        keep = tl.zeros([E_PAD], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_scores, axis=0)
            keep = keep | (group == pick)
            group_scores = tl.where(g_offs == pick, -float("inf"), group_scores)
        keep = keep & valid
        if METHOD == 1:   # transformers' V2: masked_fill(~mask, 0.0) on the scores
            choice = tl.where(keep, choice, tl.where(valid, 0.0, -float("inf")))
        else:
            choice = tl.where(keep, choice, -float("inf"))
    k_offs = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(choice, axis=0)
        if METHOD == 2:   # weights from the unbiased scores
            w = tl.sum(tl.where(offs == pick, scores, 0.0), axis=0)
        else:
            w = tl.max(tl.where(offs == pick, choice, -float("inf")), axis=0)
        top_w = tl.where(k_offs == j, w, top_w)
        top_i = tl.where(k_offs == j, pick, top_i)
        choice = tl.where(offs == pick, -float("inf"), choice)
    if NORM:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    top_w = top_w * scaling
    # a NaN row (a CUDA graph's padding row) may argmax anywhere: keep its ids in range
    top_i = tl.minimum(tl.maximum(top_i, 0), num_experts - 1)
    physical = tl.load(map_ptr + top_i)
    tl.store(weights_ptr + row * TOP_K + k_offs, top_w, mask=k_offs < TOP_K)
    tl.store(ids_ptr + row * TOP_K + k_offs, physical, mask=k_offs < TOP_K)


def route(router_logits: torch.Tensor, *, top_k: int, scoring_func: str, topk_method: str,
          n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
          e_score_correction_bias: torch.Tensor | None, logical_to_physical: torch.Tensor,
          settings: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `engine.moe.gating.select_experts` (arguments spelled out, since kernels/
    imports nothing of engine/), plus the logical -> physical map.

    Args:
        router_logits: [T, E] float32 (or any float dtype; read as float32).
        logical_to_physical: [E] int64.
        settings: kernel choices (`KernelConfig.pdl`: launched with PDL on Hopper).
    Returns:
        (topk_weights [T, top_k] float32, physical ids [T, top_k] int64), sorted by choice.
    """
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=logical_to_physical.dtype,
                      device=router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        bias = e_score_correction_bias if e_score_correction_bias is not None else logits
        options = pdl.launch_options(router_logits.device, settings)
        _route_kernel[(num_tokens,)](
            logits, bias, logical_to_physical, weights, ids, num_experts, logits.stride(0),
            float(routed_scaling_factor), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
            SIGMOID=scoring_func == "sigmoid", METHOD=METHODS[topk_method],
            N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=norm_topk_prob,
            HAS_BIAS=topk_method == "noaux_tc" and e_score_correction_bias is not None,
            E_PAD=triton.next_power_of_2(num_experts),
            G_PAD=triton.next_power_of_2(n_group), PDL=bool(options),
            num_warps=4 if num_experts > 128 else 1, **options)
    return weights, ids
