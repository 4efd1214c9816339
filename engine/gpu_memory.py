"""GPU memory planning: how many bytes the KV cache may take on a CUDA device.

The rule of vLLM's `Worker.determine_available_memory`: run one forward pass at the largest step
the scheduler can form (`max_num_batched_tokens` tokens of one sequence) plus the logits and a
softmax of `max_num_seqs` rows (the sampler's float32 temporaries), read the peak of torch's
allocator, and give the KV cache what is left of `gpu_memory_utilization` x total memory after
that peak and after the memory held outside torch's allocator (CUDA context, other processes).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepinfer.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def _profile_metadata(num_tokens: int, block_size: int, device: torch.device
                      ) -> AttentionMetadata:
    """One fresh sequence of `num_tokens` tokens in blocks 0..n-1 of a scratch cache."""
    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens, query_lens_cpu=[num_tokens],
        seq_lens_cpu=[num_tokens])


@torch.inference_mode()
def _peak_step_bytes(model: nn.Module, spec, dtype: torch.dtype, device: torch.device,
                     num_tokens: int, num_rows: int, block_size: int) -> int:
    """Peak bytes torch's allocator holds during one profiling step, the scratch KV excluded."""
    num_blocks = -(-num_tokens // block_size)
    kv_caches = [torch.zeros(spec.kv_cache_shape(num_blocks, block_size), dtype=dtype,
                             device=device) for _ in range(spec.num_layers)]
    scratch_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device),
                   torch.arange(num_tokens, device=device), kv_caches,
                   _profile_metadata(num_tokens, block_size, device))
    logits = model.compute_logits(hidden[num_tokens - num_rows:])  # [rows, V] float32
    logits.softmax(dim=-1)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - scratch_bytes


def profile_kv_cache_budget(model: nn.Module, spec, *, dtype: torch.dtype,
                            device: torch.device, block_size: int, max_num_batched_tokens: int,
                            max_num_seqs: int, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take on `device` (see the module docstring).

    Args:
        model: the loaded model, on `device` (its weights count toward the peak).
        spec: the model's KV cache spec (`kv_cache_shape`, `num_layers`, `block_bytes`).
        gpu_memory_utilization: share of total device memory the engine may use, (0, 1].
    Raises:
        ValueError: less than one KV block fits; the message gives the numbers and the fix.
    """
    max_position = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    num_tokens = max(1, min(max_num_batched_tokens, max_position or max_num_batched_tokens))
    torch.cuda.empty_cache()
    peak_bytes = _peak_step_bytes(model, spec, dtype, device, num_tokens,
                                  min(max_num_seqs, num_tokens), block_size)
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    outside_torch_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved(device)
    budget = int(total_bytes * gpu_memory_utilization) - outside_torch_bytes - peak_bytes
    gib = 2 ** 30
    logger.info("GPU memory: total %.1f GiB, weights+activations peak %.2f GiB, outside torch "
                "%.2f GiB -> KV cache %.1f GiB (gpu_memory_utilization=%.2f)",
                total_bytes / gib, peak_bytes / gib, outside_torch_bytes / gib, budget / gib,
                gpu_memory_utilization)
    if budget < spec.block_bytes(block_size):
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} of {total_bytes / gib:.1f} GiB "
            f"leaves no room for the KV cache: weights and activations peak at "
            f"{peak_bytes / gib:.1f} GiB and {outside_torch_bytes / gib:.1f} GiB is held "
            f"outside torch. Raise --gpu-memory-utilization, lower --max-num-batched-tokens, "
            f"or use a smaller model.")
    return budget
