"""Fused MoE routing in Triton: router logits -> scores -> (grouped) top-k -> weights, one
program per token, one launch per layer (the torch ops take ~8 per layer at decode).

Same arithmetic as `engine.moe.gating.select_experts` (transformers' DeepseekV2/V3 routers):
scores = softmax or sigmoid of the float32 logits; "noaux_tc" adds the correction bias for the
choice only and ranks groups by the sum of their two best biased scores, "group_limited_greedy"
ranks groups by their best score and zeroes the experts outside the `topk_group` best groups;
then top-k by iterated argmax (ties go to the lower expert id), weights renormalised with
`norm_topk_prob`, times `routed_scaling_factor`; ids mapped logical -> physical in the same
program. No host sync: CUDA-graph safe.

`route_hidden` (decode, up to `KernelConfig.moe_fused_router_max_rows` tokens) also computes
the router logits `hidden @ gate_weight.T` in float32 in the same launch, replacing the
float32 cast of hidden and cuBLAS's GEMV (two kernels at one row: a split-K GEMM and its
reduce): program (expert tile, K chunk) loads its gate-weight tile before the PDL wait (the
weights do not depend on the previous kernel), multiplies every token's chunk of hidden, stores
float32 partial logits and counts itself in on an arrival counter; the last program to arrive
sums each token's partials in chunk order (deterministic whichever program finishes last) and
routes the tokens one after another, then resets the counter (the last of
`backends.arrival_counters`: split-K GEMMs of the shared experts, which count from the first,
may run concurrently on a second stream).
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
    _route_row(x, row, bias_ptr, map_ptr, weights_ptr, ids_ptr, num_experts, scaling, TOP_K,
               SIGMOID, METHOD, N_GROUP, TOPK_GROUP, NORM, HAS_BIAS, E_PAD, G_PAD, K_PAD)


@triton.jit
def _route_row(x, row, bias_ptr, map_ptr, weights_ptr, ids_ptr, num_experts, scaling,
               TOP_K: tl.constexpr, SIGMOID: tl.constexpr, METHOD: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
               HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr,
               K_PAD: tl.constexpr):
    """Route one token: x [E_PAD] float32 logits (-inf past num_experts) -> its TOP_K weights
    and physical ids stored as row `row` of weights_ptr / ids_ptr."""
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
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


@triton.jit
def _router_logits_route_kernel(hidden_ptr, gate_ptr, partial_ptr, counter_ptr, bias_ptr,
                                map_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
                                hidden_size, stride_h, scaling, BLOCK_E: tl.constexpr,
                                BLOCK_K: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                                TOP_K: tl.constexpr, SIGMOID: tl.constexpr,
                                METHOD: tl.constexpr, N_GROUP: tl.constexpr,
                                TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                                HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr,
                                G_PAD: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr):
    pid_e = tl.program_id(0)
    pid_k = tl.program_id(1)
    experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    e_ok = experts < num_experts
    k_ok = ks < hidden_size
    # the gate weights do not depend on the previous kernel: loaded before the wait
    w = tl.load(gate_ptr + experts.to(tl.int64)[:, None] * hidden_size + ks[None, :],
                mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BE, BK]
    pdl.wait_and_release(PDL, True)
    for t in range(num_tokens):
        x = tl.load(hidden_ptr + t * stride_h + ks, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], axis=1)                                  # [BE]
        tl.store(partial_ptr + (pid_k * num_tokens + t) * num_experts + experts, part,
                 mask=e_ok)
    tl.debug_barrier()  # every thread's partials are written before the arrival is counted
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * NUM_CHUNKS - 1:   # the last program routes every token
        tl.debug_barrier()
        offs = tl.arange(0, E_PAD)
        valid = offs < num_experts
        for t in range(num_tokens):
            logits = tl.zeros([E_PAD], tl.float32)
            for chunk in tl.static_range(NUM_CHUNKS):   # in chunk order: deterministic
                logits += tl.load(partial_ptr + (chunk * num_tokens + t) * num_experts + offs,
                                  mask=valid, other=0.0, cache_modifier=".cg")
            logits = tl.where(valid, logits, -float("inf"))
            _route_row(logits, t, bias_ptr, map_ptr, weights_ptr, ids_ptr, num_experts,
                       scaling, TOP_K, SIGMOID, METHOD, N_GROUP, TOPK_GROUP, NORM, HAS_BIAS,
                       E_PAD, G_PAD, K_PAD)
        tl.atomic_xchg(counter_ptr, 0)


def route_hidden(hidden: torch.Tensor, gate_weight: torch.Tensor, *, top_k: int,
                 scoring_func: str, topk_method: str, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float,
                 e_score_correction_bias: torch.Tensor | None, logical_to_physical: torch.Tensor,
                 settings: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(hidden.float() @ gate_weight.float().T, ...)` in one launch (few tokens: the
    last program routes them one after another).

    Args:
        hidden: [T, hidden_size] (any float dtype, unit stride on the last dim; read as float32).
        gate_weight: [E, hidden_size] contiguous, float32 or bf16 (read as float32).
        The rest: as `route`.
    Returns:
        (topk_weights [T, top_k] float32, physical ids [T, top_k] of logical_to_physical's
        dtype). The logits are float32 sums over 256-wide chunks of hidden, added in chunk
        order (not cuBLAS's order: relative differences ~1e-7).
    """
    from deepinfer.kernels.backends import MAX_ARRIVAL_COUNTERS, arrival_counters

    num_tokens, hidden_size = hidden.shape
    num_experts = gate_weight.shape[0]
    device = hidden.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=logical_to_physical.dtype, device=device)
    if num_tokens == 0:
        return weights, ids
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    gate_weight = gate_weight.contiguous()
    block_e, block_k = 16, 256   # 16 KB of float32 weight per program: 32 programs for V2-Lite
    num_chunks = triton.cdiv(hidden_size, block_k)
    partial = torch.empty(num_chunks, num_tokens, num_experts, dtype=torch.float32,
                          device=device)   # [chunks, T, E] float32 partial logits
    bias = e_score_correction_bias if e_score_correction_bias is not None else partial
    # the last counter: the split-K skinny GEMMs count from the first, and the shared experts'
    # may run concurrently on a second stream (engine.models.deepseek.DeepseekMoEBlock)
    counter = arrival_counters(device)[MAX_ARRIVAL_COUNTERS - 1:]
    options = pdl.launch_options(device, settings)
    _router_logits_route_kernel[(triton.cdiv(num_experts, block_e), num_chunks)](
        hidden, gate_weight, partial, counter, bias, logical_to_physical,
        weights, ids, num_tokens, num_experts, hidden_size, hidden.stride(0),
        float(routed_scaling_factor), BLOCK_E=block_e, BLOCK_K=block_k, NUM_CHUNKS=num_chunks,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        SIGMOID=scoring_func == "sigmoid", METHOD=METHODS[topk_method],
        N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=norm_topk_prob,
        HAS_BIAS=topk_method == "noaux_tc" and e_score_correction_bias is not None,
        E_PAD=triton.next_power_of_2(num_experts), G_PAD=triton.next_power_of_2(n_group),
        PDL=bool(options), num_warps=4, **options)
    return weights, ids
