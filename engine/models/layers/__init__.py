"""Layers shared by the model families: linear, RMSNorm, rotary embedding, gated MLP, paged
attention. Each documents its tensors' shapes and dtypes.

The layers that call GPU kernels with choices (`Linear`, `RMSNorm`, `PagedAttention`, Llama's
folded decoder layer) hold a `kernel_config` (`KernelConfig`, default: the measured defaults);
`set_kernel_config` gives a whole model the engine's one."""

from __future__ import annotations

from torch import nn

from deepinfer.kernels.settings import KernelConfig


def set_kernel_config(model: nn.Module, kernel_config: KernelConfig) -> None:
    """Hand `kernel_config` to every layer of `model` that calls kernels with choices (those
    whose class declares a `kernel_config`). CUDA graphs captured before keep the old choices:
    capture them again after a change."""
    for module in model.modules():
        if hasattr(type(module), "kernel_config"):
            module.kernel_config = kernel_config
