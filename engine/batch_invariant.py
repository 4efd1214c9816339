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


def check_batch_invariant(kernel: KernelConfig, device: torch.device, hf_config) -> None:
    """Refuse `kernel.batch_invariant` where it is not kept, and log what the mode runs.
    `hf_config`: the model's HF config (its `architectures` name the model class).

    Raises:
        ValueError: for a model class that does not declare `supports_batch_invariant`
            (DeepSeek's MoE / MLA kernels, vision encoders), or on CUDA without Triton.
    """
    if not kernel.batch_invariant:
        return
    how = "drop --batch-invariant (DEEPINFER_BATCH_INVARIANT=0)"
    model_class = get_model_class(hf_config)
    if not getattr(model_class, "supports_batch_invariant", False):
        raise ValueError(f"batch_invariant is not supported for {model_class.__name__} yet "
                         "(Llama-family text models are: Llama, Qwen2, SmolLM2); " + how + ".")
    if device.type == "cuda":
        if not triton_available():
            raise ValueError("batch_invariant on CUDA needs Triton (its invariant GEMM and "
                             f"attention kernels); install triton or {how}.")
        summary = ("linears run the Triton GEMM at one tile config per weight shape (64-row "
                   "tiles, one K split; no cuBLAS, no fused norm / residual epilogues); "
                   "attention runs one program per token and kv head over its whole context, "
                   "prefill included (no split-K; slower prefill)")
    elif device.type == "cpu":
        summary = batch_invariant_summary()
    else:
        raise ValueError(f"batch_invariant runs on CPU and CUDA, not on {device.type}; {how}.")
    logger.info("batch-invariant mode: %s", summary)
