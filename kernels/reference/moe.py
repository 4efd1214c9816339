"""Reference routed-expert computation of a Mixture-of-Experts layer: a loop over every expert,
tokens picked with index_select. The test oracle.

Each expert is a SwiGLU MLP, `down(silu(gate(x)) * up(x))` (DeepSeekMoE, DeepSeek-V2 arXiv
2405.04434 §2.2); a token's output is the routing-weighted sum of its top-k experts' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's selected experts.

    Args:
        hidden: [num_tokens, hidden_size].
        w13: [num_experts, 2 * intermediate_size, hidden_size], hidden's dtype: rows [0, I) the
            gate projection, [I, 2I) the up projection.
        w2: [num_experts, hidden_size, intermediate_size], the down projection.
        topk_weights: [num_tokens, top_k] float32 routing weights.
        topk_ids: [num_tokens, top_k] int64 expert indices into w13 / w2.
    Returns:
        [num_tokens, hidden_size], hidden's dtype.
    """
    out = torch.zeros_like(hidden, dtype=torch.float32)
    intermediate = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        token_idx, k_pos = torch.where(topk_ids == expert)
        if token_idx.numel() == 0:
            continue
        x = hidden.index_select(0, token_idx)  # [n, hidden_size]
        gate_up = x @ w13[expert].T  # [n, 2I]
        y = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]) @ w2[expert].T
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, k_pos, None])
    return out.to(hidden.dtype)
