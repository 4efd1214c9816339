"""Routed experts in torch ops grouped by expert: the (token, k) pairs are sorted by expert
once, so each hit expert runs two GEMMs on one contiguous slice of rows, and experts no token
picked cost nothing. Runs on any device; one host sync (the per-expert counts) per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as `kernels.reference.moe.moe_experts`."""
    num_tokens, top_k = topk_ids.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_idx = order // top_k
    x = hidden.index_select(0, token_idx)  # [num_tokens * top_k, hidden_size], expert-sorted
    y = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate_up = x[rows] @ w13[expert].T  # [count, 2I]
            torch.mm(F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:],
                     w2[expert].T, out=y[rows])
            start += count
    weights = topk_weights.reshape(-1).index_select(0, order)[:, None]  # [N, 1] float32
    weighted = y.float().mul_(weights)  # [N, hidden_size], expert-sorted
    # back to (token, k) order (argsort of a permutation is its inverse), then sum over k
    unsorted = weighted.index_select(0, torch.argsort(order))
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
