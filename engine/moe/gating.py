"""Expert selection for DeepSeek-style MoE layers: router scores -> top-k experts and weights.

`topk_method` (the HF config key):
- "greedy": plain top-k of the scores (DeepSeek-V2-Lite).
- "group_limited_greedy": device-limited routing of DeepSeek-V2 (arXiv 2405.04434 §2.2.2):
  experts form `n_group` groups; keep the `topk_group` groups with the highest single expert
  score, then top-k among their experts.
- "noaux_tc": DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437 §2.1.2): a per-expert
  bias `e_score_correction_bias` is added to the scores for *selection only*; groups are ranked
  by the sum of their two best biased scores, and the gating weights come from the unbiased
  scores.
`scoring_func` is "softmax" (V2) or "sigmoid" (V3). With `norm_topk_prob` the selected weights
are renormalised to sum to 1 (V3: `w / (sum w + 1e-20)`); all weights are finally multiplied by
`routed_scaling_factor`. The arithmetic follows transformers' DeepseekV2/V3 routers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.backends import triton_available
from deepinfer.kernels.settings import DEFAULT, KernelConfig

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingConfig:
    """How a layer picks experts (field names are the HF config keys)."""

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported; use one of "
                             f"{SCORING_FUNCS}.")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not supported; use one of "
                             f"{TOPK_METHODS}.")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, "
                             f"n_routed_experts={self.num_experts}].")
        if self.topk_method != "greedy":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"n_routed_experts={self.num_experts} is not divisible into "
                                 f"n_group={self.n_group} groups.")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in [1, "
                                 f"n_group={self.n_group}].")
            if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
                raise ValueError(f"noaux_tc ranks groups by their two best experts; "
                                 f"n_routed_experts={self.num_experts} in n_group={self.n_group} "
                                 "groups leaves fewer than 2 per group.")


def _group_mask(choice_scores: torch.Tensor, config: RoutingConfig, *,
                top2_sum: bool) -> torch.Tensor:
    """[T, E] bool: experts inside the `topk_group` best groups of each token."""
    num_tokens = choice_scores.shape[0]
    grouped = choice_scores.view(num_tokens, config.n_group, -1)  # [T, G, E/G]
    if top2_sum:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, True)
    return group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, -1)


def select_experts(router_logits: torch.Tensor, config: RoutingConfig,
                   e_score_correction_bias: torch.Tensor | None = None, *,
                   logical_to_physical: torch.Tensor | None = None, backend: str = "auto",
                   settings: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's top-k experts. Device ops only, never a host sync (CUDA-graph safe).

    Args:
        router_logits: [num_tokens, num_experts] float32 (`hidden @ gate.weight.T`).
        config: the routing settings.
        e_score_correction_bias: [num_experts] float32, used by "noaux_tc" (zeros if None).
        logical_to_physical: [num_experts] int64: return physical ids (`map[logical]`).
        backend: "auto" (the one-launch Triton kernel `kernels/moe_routing_triton.py` on CUDA
            where Triton is installed, else torch ops), "torch" or "triton".
        settings: kernel choices (`KernelConfig.pdl`: the Triton kernel's PDL launch).
    Returns:
        (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64 logical
        expert ids, physical with `logical_to_physical`). The order of the k columns is
        unspecified.
    """
    if backend == "triton" or (backend == "auto" and router_logits.is_cuda
                               and triton_available()):
        from deepinfer.kernels.moe_routing_triton import route

        mapping = (logical_to_physical if logical_to_physical is not None else
                   torch.arange(config.num_experts, device=router_logits.device))
        return route(router_logits, top_k=config.top_k, scoring_func=config.scoring_func,
                     topk_method=config.topk_method, n_group=config.n_group,
                     topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
                     routed_scaling_factor=config.routed_scaling_factor,
                     e_score_correction_bias=e_score_correction_bias,
                     logical_to_physical=mapping, settings=settings)
    topk_weights, topk_ids = _select_experts_torch(router_logits, config,
                                                   e_score_correction_bias)
    if logical_to_physical is not None:
        topk_ids = logical_to_physical[topk_ids]
    return topk_weights, topk_ids


def route_hidden(hidden: torch.Tensor, gate_weight: torch.Tensor, config: RoutingConfig,
                 e_score_correction_bias: torch.Tensor | None = None, *,
                 logical_to_physical: torch.Tensor, settings: KernelConfig = DEFAULT
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(hidden.float() @ gate_weight.T, ...)`: the router logits and the choice.

    Up to `settings.moe_fused_router_max_rows` tokens on CUDA with Triton, one launch
    (`kernels.moe_routing_triton.route_hidden`: logits summed in 256-wide chunks, not
    cuBLAS's order); otherwise the float32 GEMM (in the batch-invariant mode the fixed-order
    one of `kernels.linear`), then `select_experts`.

    Args:
        hidden: [num_tokens, hidden_size], model dtype.
        gate_weight: [num_experts, hidden_size] float32 (or bf16, read as float32).
        logical_to_physical: [num_experts] int64.
    Returns:
        (topk_weights [num_tokens, top_k] float32, physical ids [num_tokens, top_k] int64).
    """
    if (hidden.is_cuda and 0 < hidden.shape[0] <= settings.moe_fused_router_max_rows
            and triton_available() and not settings.batch_invariant):
        from deepinfer.kernels.moe_routing_triton import route_hidden as fused

        return fused(hidden, gate_weight, top_k=config.top_k,
                     scoring_func=config.scoring_func, topk_method=config.topk_method,
                     n_group=config.n_group, topk_group=config.topk_group,
                     norm_topk_prob=config.norm_topk_prob,
                     routed_scaling_factor=config.routed_scaling_factor,
                     e_score_correction_bias=e_score_correction_bias,
                     logical_to_physical=logical_to_physical, settings=settings)
    if settings.batch_invariant:   # a fixed-order float32 GEMM (kernels/linear.py)
        from deepinfer.kernels.linear import linear

        router_logits = linear(hidden.float(), gate_weight.float(), settings=settings)
    else:
        router_logits = hidden.float() @ gate_weight.float().T  # [T, num_experts] float32
    return select_experts(router_logits, config, e_score_correction_bias,
                          logical_to_physical=logical_to_physical, settings=settings)


def _select_experts_torch(router_logits: torch.Tensor, config: RoutingConfig,
                          e_score_correction_bias: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = router_logits.float()
    scores = logits.sigmoid() if config.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    if config.topk_method == "greedy":
        topk_weights, topk_ids = torch.topk(scores, k=config.top_k, dim=-1, sorted=False)
    elif config.topk_method == "group_limited_greedy":
        mask = _group_mask(scores, config, top2_sum=False)
        topk_weights, topk_ids = torch.topk(scores.masked_fill(~mask, 0.0), k=config.top_k,
                                            dim=-1, sorted=False)
    else:  # noaux_tc
        choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias
        mask = _group_mask(choice, config, top2_sum=True)
        topk_ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=config.top_k,
                              dim=-1, sorted=False).indices
        topk_weights = scores.gather(1, topk_ids)
    if config.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * config.routed_scaling_factor, topk_ids
