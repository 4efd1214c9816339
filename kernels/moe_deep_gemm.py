"""Routed experts on DeepGEMM's grouped GEMM, where a user has installed `deep_gemm` (never
required; it does not build on our CI machines, so it is tested for dispatch and layout only).

DeepGEMM's "contiguous" grouped layout (github.com/deepseek-ai/DeepGEMM): the rows of all
experts stacked, each expert's run padded to `get_mk_alignment_for_contiguous_layout()` rows
(128), and `m_indices[row]` = the row's expert (-1: a padding row, skipped). Our on-device
alignment (`moe_triton.align`) already produces exactly that with block_m = the alignment, so
this backend only gathers the rows, runs `m_grouped_bf16_gemm_nt_contiguous` for gate_up and
down (SiLU-and-mul between them in torch), applies the routing weights and sums over top_k.
DeepGEMM's contiguous layout suits prefill (many rows per expert); `moe.moe_experts` picks it
under backend="auto" only from `KernelConfig.moe_deep_gemm_min_rows` mean rows per expert.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from deepinfer.kernels.settings import DEFAULT, KernelConfig


@functools.cache
def available() -> bool:
    """True if `deep_gemm` is importable and has the bf16 contiguous grouped GEMM."""
    if importlib.util.find_spec("deep_gemm") is None:
        return False
    try:
        import deep_gemm
    except ImportError:   # installed but broken (no CUDA toolkit, wrong arch): not usable
        return False
    return hasattr(deep_gemm, "m_grouped_bf16_gemm_nt_contiguous")


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                settings: KernelConfig = DEFAULT) -> torch.Tensor:
    """Same contract as `kernels.reference.moe.moe_experts`; no host sync."""
    import deep_gemm

    from deepinfer.kernels.moe_triton import align

    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, hidden_size = w13.shape
    num_pairs = num_tokens * top_k
    block = (deep_gemm.get_mk_alignment_for_contiguous_layout()
             if hasattr(deep_gemm, "get_mk_alignment_for_contiguous_layout") else 128)
    sorted_pairs, block_expert, _ = align(topk_ids, num_experts, block)
    real = sorted_pairs < num_pairs
    m_indices = torch.where(real, block_expert.repeat_interleave(block), -1).to(torch.int32)
    rows = hidden.index_select(0, torch.where(real, sorted_pairs // top_k, 0))
    gate_up = rows.new_empty(rows.shape[0], inter2)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(rows, w13, gate_up, m_indices)
    act = F.silu(gate_up[:, :inter2 // 2]) * gate_up[:, inter2 // 2:]
    down = rows.new_empty(rows.shape[0], hidden_size)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(act.contiguous(), w2, down, m_indices)
    pair = torch.where(real, sorted_pairs, num_pairs).long()   # padding rows -> a spare row
    weights = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1)])
    per_pair = torch.zeros(num_pairs + 1, hidden_size, dtype=torch.float32,
                           device=hidden.device)
    per_pair.index_add_(0, pair, down.float() * weights[pair, None])
    return per_pair[:num_pairs].view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
