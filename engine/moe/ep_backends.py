"""Expert-parallel dispatch/combine backends: which one runs (`resolve_ep_backend`) and the
DeepEP adapter (`DeepEPDispatcher`).

- "all_to_all" (engine/moe/expert_parallel.py): `torch.distributed.all_to_all_single` over the
  EP group, on any backend (gloo on CPU, NCCL on CUDA); a host sync on the split sizes per
  layer. Always available; the tested path.
- "deep_ep": DeepSeek's DeepEP library (github.com/deepseek-ai/DeepEP), normal mode, through
  its public `deep_ep.Buffer` API: `get_dispatch_layout` -> `dispatch` -> the local experts ->
  `combine`. CUDA only (NVLink / RDMA kernels), bf16 hidden states, float32 top-k weights.
  Imported only when selected. **Untested here**: the library is not installable on this
  project's machines (it builds against NVSHMEM and needs a GPU); only the selection logic is
  tested, with a stand-in module. The adapter follows DeepEP's README ("Example use in model
  training or inference prefilling") and the way Megatron-LM's `fused_a2a.py` calls it.

`ep_backend="auto"` picks deep_ep on CUDA when `import deep_ep` succeeds, else all_to_all;
"deep_ep" where it cannot run is a configuration error (the message says why and what to do).
"""

from __future__ import annotations

import importlib

import torch

from deepinfer.engine.config import ConfigError
from deepinfer.kernels.moe import moe_experts

__all__ = ["DeepEPDispatcher", "deep_ep_module", "resolve_ep_backend"]


def deep_ep_module():
    """The `deep_ep` module, or None when it cannot be imported."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError:
        return None


def resolve_ep_backend(ep_backend: str, device_type: str) -> str:
    """The dispatch/combine backend that runs: "all_to_all" or "deep_ep".

    Args:
        ep_backend: `ParallelConfig.ep_backend` ("auto", "all_to_all", "deep_ep").
        device_type: "cpu" or "cuda" (the ranks' device).
    Raises:
        ConfigError: "deep_ep" on a CPU, or where `import deep_ep` fails.
    """
    if ep_backend == "all_to_all":
        return "all_to_all"
    on_cuda = device_type == "cuda"
    if ep_backend == "auto":
        return "deep_ep" if on_cuda and deep_ep_module() is not None else "all_to_all"
    if not on_cuda:
        raise ConfigError(f"ep_backend=deep_ep runs DeepEP's CUDA kernels, and the device is "
                          f"{device_type}; use --ep-backend all_to_all (or auto).",
                          "ep_backend")
    if deep_ep_module() is None:
        raise ConfigError("ep_backend=deep_ep needs the `deep_ep` package (DeepEP, built "
                          "against NVSHMEM: github.com/deepseek-ai/DeepEP), and it cannot be "
                          "imported here; install it or use --ep-backend all_to_all (or auto).",
                          "ep_backend")
    return "deep_ep"


class DeepEPDispatcher:
    """Dispatch + local experts + combine of one MoE layer through a DeepEP `Buffer` (normal
    mode), shared by the layers of a rank. Untested (module doc).

    Args:
        group: the EP process group (NCCL).
        hidden_size: H; the buffer is sized for [*, H] bf16 rows.
        num_physical: P physical expert slots; rank r holds [r * P / world, (r + 1) * P / world)
            (DeepEP's expert layout: contiguous equal ranges per rank).
    """

    def __init__(self, group, hidden_size: int, num_physical: int):
        deep_ep = deep_ep_module()
        if deep_ep is None:
            raise ConfigError("ep_backend=deep_ep: `import deep_ep` failed.", "ep_backend")
        world = group.size()
        hidden_bytes = hidden_size * 2   # bf16 rows
        num_nvl_bytes = num_rdma_bytes = 0
        for config in (deep_ep.Buffer.get_dispatch_config(world),
                       deep_ep.Buffer.get_combine_config(world)):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world),
                                num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, world),
                                 num_rdma_bytes)
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
        self.num_physical = num_physical

    def forward(self, moe, hidden: torch.Tensor, topk_weights: torch.Tensor,
                physical: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] bf16, topk_weights [T, k] float32, physical [T, k] int64 slots ->
        the routed experts' weighted sum [T, H] (hidden's dtype). Each token travels once to
        each rank holding one of its slots; the rank weights its experts' outputs (DeepEP
        gives the received top-k as local expert ids, -1 for slots elsewhere) and `combine`
        sums the ranks' rows back in token order."""
        buffer = self.buffer
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
         is_token_in_rank, _) = buffer.get_dispatch_layout(physical, self.num_physical)
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            hidden.to(torch.bfloat16), topk_idx=physical, topk_weights=topk_weights.float(),
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
        if recv_x.shape[0]:
            here = recv_ids >= 0
            y = moe_experts(recv_x, moe.w13, moe.w2, torch.where(here, recv_weights, 0.0),
                            recv_ids.clamp_min(0), backend=moe.backend,
                            settings=moe.kernel_config, w13_scale=moe.w13_scale,
                            w2_scale=moe.w2_scale)
        else:
            y = recv_x
        combined, _, _ = buffer.combine(y.to(torch.bfloat16), handle)
        return combined.to(hidden.dtype)
