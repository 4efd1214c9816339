"""Public MoE expert computation `moe_experts`, dispatched to a backend.

Backends, imported lazily on first use:
- "reference": `kernels/reference/moe.py`, a loop over all experts with index_select (the oracle).
- "torch": `kernels/moe_torch.py`, (token, k) pairs sorted by expert, one GEMM pair per hit
  expert on a contiguous slice.
`backend="auto"` is "torch"; a grouped-GEMM backend (Triton on CUDA) registers in
`_BACKENDS` with an `auto` rule.

Expert weights are addressed by *physical* expert index (the model maps logical → physical
before calling), so replicated or re-placed experts (EPLB) need no change here.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.backends import Backends

_BACKENDS = Backends("MoE", {"reference": "deepinfer.kernels.reference.moe", "torch": "deepinfer.kernels.moe_torch"})
BACKENDS = _BACKENDS.names


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                backend: str = "auto") -> torch.Tensor:
    """Each token's routing-weighted sum of its top-k SwiGLU experts.

    Args:
        hidden: [num_tokens, hidden_size].
        w13: [num_physical_experts, 2 * intermediate_size, hidden_size], hidden's dtype (gate
            rows then up rows).
        w2: [num_physical_experts, hidden_size, intermediate_size] (down projection).
        topk_weights: [num_tokens, top_k] float32.
        topk_ids: [num_tokens, top_k] int64 physical expert ids, each < num_physical_experts.
        backend: "auto", "reference" or "torch".
    Returns:
        [num_tokens, hidden_size], hidden's dtype (sums accumulated in float32).
    """
    experts = _BACKENDS.get(backend, hidden.device)
    return experts.moe_experts(hidden, w13, w2, topk_weights, topk_ids)
