"""`Linear`: a weight (and optional bias) that can be packed once for fast CPU GEMM."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.fp8 import fp8_block_linear
from deepinfer.kernels.fused_linear import AddedRows, linear_add
from deepinfer.kernels.linear import linear, linear_row_argmax, pack_linear_weight, quantize_linear_weight
from deepinfer.kernels.settings import DEFAULT, KernelConfig


class Linear(nn.Module):
    """`y = x @ weight.T + bias` with weight [out_features, in_features].

    Parameters are allocated uninitialised: a model's `load_weights` fills them, then calls
    `pack()` so the CPU path can use a pre-packed copy and, for weights that are exactly
    dequantized Q4_1 / Q8_0 blocks (GGUF models), the block-quantized kernel for decode-sized
    inputs (see `kernels/linear.py`). Call `pack()` again after changing the weight in place.
    `kernel_config`: the GPU kernel choices (`layers.set_kernel_config` sets the engine's).
    A block-scaled FP8 checkpoint may leave `weight` float8_e4m3fn with its `weight_scale_inv`
    ([ceil(out/bn), ceil(in/bk)] float32) and `fp8_block_size` (bn, bk) set
    (`engine.models.fp8.Fp8LinearStaging`); forward then runs `kernels.fp8.fp8_block_linear`.
    """

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed_weight: torch.Tensor | None = None
        self.quantized_weight = None  # kernels.quantized_linear.QuantizedWeight | None
        self.weight_scale_inv: torch.Tensor | None = None  # FP8 weights only
        self.fp8_block_size: tuple[int, int] | None = None

    def pack(self) -> None:
        """Refresh the packed and quantized copies of the weight (a no-op off CPU float32). In
        the batch-invariant mode (`kernel_config`, set before the weights load) no oneDNN copy
        is made: the mode's linears never read it."""
        self.packed_weight = (None if self.kernel_config.batch_invariant
                              else pack_linear_weight(self.weight))
        self.quantized_weight = quantize_linear_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features], the weight's dtype (x's
        for an FP8 weight)."""
        if self.weight_scale_inv is not None:
            return fp8_block_linear(x, self.weight, self.weight_scale_inv, self.bias,
                                    block_size=self.fp8_block_size, settings=self.kernel_config)
        return linear(x, self.weight, self.bias, self.packed_weight, self.quantized_weight,
                      settings=self.kernel_config)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor | AddedRows | None, torch.Tensor]:
        """`kernels.fused_linear.linear_add`: x [num_tokens, in_features], residual
        [num_tokens, out_features] the residual stream -> (pending, residual), the add done in
        the GEMM's epilogue where the fused kernel runs (pending None or AddedRows, residual
        overwritten), else (`forward(x)`, residual). FP8 weights and CPU packed / quantized
        copies always take `forward` (the fused kernel reads a plain weight of x's dtype)."""
        if self.plain_weight is None:
            return self.forward(x), residual
        return linear_add(x, self.weight, self.bias, residual, settings=self.kernel_config)

    def forward_row_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`forward(x)`, each row's first maximal column [num_tokens] int64 where the GEMM's
        epilogue took it (`kernels.linear.linear_row_argmax`), else None)."""
        if self.bias is not None or self.plain_weight is None:
            return self.forward(x), None
        return linear_row_argmax(x, self.weight, settings=self.kernel_config)

    @property
    def plain_weight(self) -> torch.Tensor | None:
        """`weight` ([out_features, in_features], the compute dtype) where it is all this
        layer computes from, so a fused kernel may read it: None for FP8 codes and where a CPU
        packed or quantized copy runs."""
        if (self.weight_scale_inv is not None or self.packed_weight is not None
                or self.quantized_weight is not None):
            return None
        return self.weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packed_weight is not None}, "
                f"quantized={getattr(self.quantized_weight, 'format', None)}"
                f"{', fp8' if self.weight_scale_inv is not None else ''}")
