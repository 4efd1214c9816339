"""Loading FP8 block-scaled checkpoints (DeepSeek-V3 format) by dequantizing at load time.

config.json: `"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
...}`; each quantized linear has `<name>.weight` (float8_e4m3fn) and `<name>.weight_scale_inv`
(float32, one per block). No FP8 GEMM kernel exists here yet, so weights become the compute dtype
(`kernels.fp8.dequantize_block_fp8`) before the model sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from deepinfer.kernels.fp8 import dequantize_block_fp8

_SCALE_SUFFIX = ".weight_scale_inv"


def fp8_block_size(hf_config) -> tuple[int, int] | None:
    """(block_n, block_k) of a block-scaled FP8 checkpoint, or None for unquantized ones.

    Raises:
        ValueError: another quantization method, or FP8 without a weight_block_size.
    """
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method={method!r} is not supported; "
                         "deepinfer loads unquantized and block-scaled 'fp8' checkpoints.")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"fp8 quantization_config needs weight_block_size [n, k]; got {block!r} "
                         "(per-tensor FP8 scales are not supported).")
    return int(block[0]), int(block[1])


def dequantize_fp8_weights(weights: Iterable[tuple[str, torch.Tensor]],
                           block_size: tuple[int, int], dtype: torch.dtype
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, pairing each FP8 `X.weight` with its `X.weight_scale_inv` and
    yielding `X.weight` dequantized to `dtype` (the two may come in either order).

    Raises:
        ValueError: an FP8 weight without its scale, or a scale without its weight.
    """
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_SCALE_SUFFIX):
            base = name[: -len(_SCALE_SUFFIX)]
            if base in pending_weights:
                yield f"{base}.weight", dequantize_block_fp8(pending_weights.pop(base), tensor,
                                                             block_size, dtype)
            else:
                pending_scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
            base = name[: -len(".weight")]
            if base in pending_scales:
                yield name, dequantize_block_fp8(tensor, pending_scales.pop(base), block_size,
                                                 dtype)
            else:
                pending_weights[base] = tensor
        else:
            yield name, tensor
    if pending_weights or pending_scales:
        lonely = sorted(f"{n}.weight" for n in pending_weights) + sorted(
            f"{n}{_SCALE_SUFFIX}" for n in pending_scales)
        raise ValueError(f"FP8 checkpoint tensors without their pair: {lonely[:4]}; each "
                         "float8 weight needs a weight_scale_inv (and vice versa).")
