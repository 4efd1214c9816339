"""Start-up checks of the batch-invariant mode (`KernelConfig.batch_invariant`).

In that mode a request's tokens and logprobs are the same bits whatever else is batched, however
its prompt was chunked, whether its prefix came from the prefix cache or the KV store, after a
preemption, and with speculative decoding on or off: every kernel computes a row from that
row's data alone in a fixed order (kernels/linear.py, kernels/paged_attention.py; README
"Deterministic serving"). The sampler already keys its noise per (seed, position). What the
kernels cannot keep yet is refused here, before the model loads.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.engine.models import get_model_class
from deepinfer.kernels.backends import triton_available
from deepinfer.kernels.cpu_extension import batch_invariant_summary
from deepinfer.kernels.settings import KernelConfig

logger = logging.getLogger(__name__)


def check_batch_invariant(kernel: KernelConfig, device: torch.device, dtype: torch.dtype,
                          hf_config) -> None:
    """Refuse `kernel.batch_invariant` where it is not kept, and log what the mode runs.
    `dtype`: the model's; `hf_config`: its HF config (`architectures` name the model class).

    Raises:
        ValueError: a device not in the model class's `batch_invariant_devices` (DeepSeek
            models: CUDA only; vision-language models: none), CUDA without Triton, the CPU
            in a dtype other than float32 (its invariant kernels are float32), or
            `kernel.fp8_block_gemm` on.
    """
    if not kernel.batch_invariant:
        return
    how = "drop --batch-invariant (DEEPINFER_BATCH_INVARIANT=0)"
    model_class = get_model_class(hf_config)
    devices = getattr(model_class, "batch_invariant_devices", ())
    if device.type not in devices:
        where = f"on {' and '.join(d.upper() for d in devices)} only" if devices else "on no device"
        raise ValueError(f"batch_invariant is not supported for {model_class.__name__} on "
                         f"{device.type} yet ({model_class.__name__}: {where}; Llama, Qwen2 and "
                         f"SmolLM2: on CPU and CUDA); {how}.")
    if kernel.fp8_block_gemm:
        raise ValueError("batch_invariant has no FP8 block-scaled GEMM form (its row tile follows "
                         "the row count); drop fp8_block_gemm (FP8 checkpoints then dequantize "
                         f"at load) or {how}.")
    if device.type == "cuda":
        if not triton_available():
            raise ValueError("batch_invariant on CUDA needs Triton (its invariant GEMM and "
                             f"attention kernels); install triton or {how}.")
        summary = ("linears run the Triton GEMM at one tile config per weight shape (64-row "
                   "tiles, one K split; no cuBLAS, no fused norm / residual epilogues); "
                   "attention runs one program per token and kv head over its whole context, "
                   "prefill included (no split-K; slower prefill); MLA: each token a decode "
                   "row of its own at 2 fixed splits; MoE: one tile, the router's GEMM "
                   "fixed-order")
    else:
        if dtype != torch.float32:
            raise ValueError(f"batch_invariant on CPU runs float32 only (its fixed-order "
                             f"kernels are float32), not {str(dtype).removeprefix('torch.')}; "
                             f"serve with --dtype float32 (the CPU default) or {how}.")
        summary = batch_invariant_summary()
    logger.info("batch-invariant mode: %s", summary)
