"""Loading FP8 block-scaled checkpoints (DeepSeek-V3 format).

config.json: `"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
...}`; each quantized linear has `<name>.weight` (float8_e4m3fn) and `<name>.weight_scale_inv`
(float32, one per block).

On a device that runs the FP8 GEMMs (`kernels.fp8.fp8_supported`) the routed experts, most of
a DeepSeek-V3's bytes, stay FP8: the model is built with float8_e4m3fn expert tensors and
float32 scale tiles (`fp8_expert_block`, `layers.moe.MoE(fp8_block=128)`), so no bf16 copy of
them is ever allocated, and their codes and `weight_scale_inv` tiles load as stored
(`dequantize_fp8_weights(kept_codes=...)`); the grouped FP8 GEMMs of `kernels.moe_triton` run
them. Every other FP8 weight is dequantized to the compute dtype as it streams in, which is all
a CPU model does. With `KernelConfig.fp8_block_gemm`, `Fp8LinearStaging` also keeps the codes
and scales of the `Linear` modules whose checkpoint parts line up with the scale tiles, and
once loading ends swaps them in: those linears then hold float8_e4m3fn weights plus
`weight_scale_inv` and run `kernels.fp8.fp8_block_linear`. The MLA up-projection kv_b_proj
(whose W_UK / W_UV the attention kernels read in the compute dtype) and misaligned fused rows
stay dequantized.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

from deepinfer.engine.models.layers.linear import Linear
from deepinfer.kernels.fp8 import dequantize_block_fp8, fp8_supported

# checkpoint base name, FP8 codes, scales: called for each pair before its dequantized weight
PairHook = Callable[[str, torch.Tensor, torch.Tensor], None]

WEIGHT_SCALE_SUFFIX = ".weight_scale_inv"


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


def fp8_expert_block(hf_config, device: torch.device,
                     requested: bool | None = None) -> int | None:
    """The scale block (128) in which a model keeps its routed experts FP8, or None for
    experts in the compute dtype.

    FP8 experts need a block-scaled checkpoint with 128 x 128 blocks (DeepSeek-V3's), hidden
    and moe_intermediate sizes that are multiples of 128 (the grouped FP8 GEMMs take one scale
    per K step) and, unless `requested` is True, a device that runs them
    (`kernels.fp8.fp8_supported`: CUDA with Triton, compute capability >= 8.9). `requested`
    False: never; True: wherever the checkpoint allows it (CPU included, where the forward
    dequantizes each call: tests).

    Raises:
        ValueError: `requested` True for a checkpoint whose experts cannot stay FP8.
    """
    if requested is False:
        return None
    block = fp8_block_size(hf_config)
    dims = (hf_config.hidden_size, getattr(hf_config, "moe_intermediate_size", 0) or 0)
    fits = block == (128, 128) and all(d and d % 128 == 0 for d in dims)
    if requested and not fits:
        raise ValueError(f"fp8_experts=True needs an FP8 checkpoint with 128 x 128 scale blocks "
                         f"and hidden / moe_intermediate sizes that are multiples of 128; this "
                         f"one has weight_block_size {block} and sizes {dims}.")
    return 128 if fits and (requested or fp8_supported(torch.device(device))) else None


def dequantize_fp8_weights(weights: Iterable[tuple[str, torch.Tensor]],
                           block_size: tuple[int, int], dtype: torch.dtype,
                           on_pair: PairHook | None = None,
                           kept_codes: Collection[str] = ()
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, pairing each FP8 `X.weight` with its `X.weight_scale_inv` and
    yielding `X.weight` dequantized to `dtype` (the two may come in either order);
    `on_pair(X, codes, scale_inv)` sees each pair first (`Fp8LinearStaging.stage`). The bases
    X in `kept_codes` (FP8 experts) pass through as stored: `X.weight` (codes) and
    `X.weight_scale_inv`.

    Raises:
        ValueError: an FP8 weight without its scale, or a scale without its weight.
    """
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.removesuffix(WEIGHT_SCALE_SUFFIX).removesuffix(".weight") in kept_codes:
            yield name, tensor
        elif name.endswith(WEIGHT_SCALE_SUFFIX):
            base = name[: -len(WEIGHT_SCALE_SUFFIX)]
            if base in pending_weights:
                codes = pending_weights.pop(base)
                if on_pair is not None:
                    on_pair(base, codes, tensor)
                yield f"{base}.weight", dequantize_block_fp8(codes, tensor, block_size, dtype)
            else:
                pending_scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
            base = name[: -len(".weight")]
            if base in pending_scales:
                scale_inv = pending_scales.pop(base)
                if on_pair is not None:
                    on_pair(base, tensor, scale_inv)
                yield name, dequantize_block_fp8(tensor, scale_inv, block_size, dtype)
            else:
                pending_weights[base] = tensor
        else:
            yield name, tensor
    if pending_weights or pending_scales:
        lonely = sorted(f"{n}.weight" for n in pending_weights) + sorted(
            f"{n}{WEIGHT_SCALE_SUFFIX}" for n in pending_scales)
        raise ValueError(f"FP8 checkpoint tensors without their pair: {lonely[:4]}; each "
                         "float8 weight needs a weight_scale_inv (and vice versa).")


def _keeps_tiles(transform: Callable[[torch.Tensor], torch.Tensor] | None, rows: int,
                 block_n: int) -> bool:
    """True if the row permutation `transform` (the rope de-interleave) moves no row out of
    its block_n-row scale tile, so it may be applied to the FP8 codes as they are."""
    if transform is None:
        return True
    index = torch.arange(rows, dtype=torch.float64)[:, None]
    moved = transform(index)[:, 0].long()
    return torch.equal(moved // block_n, torch.arange(rows) // block_n)


class Fp8LinearStaging:
    """Collects the FP8 codes and scales of `Linear` modules while a checkpoint loads, then
    makes those linears FP8 (`finish`).

    Args:
        model: the module whose `Linear`s may stay FP8.
        targets: checkpoint name -> (destination tensor, row transform or None), the model's
            `checkpoint_targets()`; a destination that is a row slice of a Linear's weight
            (fused gate_up rows) maps to that Linear at that row offset.
        block_size: (block_n, block_k) of the checkpoint.
        exclude: Linears that must stay in the compute dtype (kv_b_proj, the LM head).
    A Linear is kept when each of its parts starts on a scale-tile row, ends on one (or at the
    weight's end), its transform keeps rows in their tiles, and all its rows arrive as FP8.
    """

    def __init__(self, model: nn.Module, targets: dict, block_size: tuple[int, int],
                 exclude: Iterable[nn.Module] = ()) -> None:
        self.block_size = block_size
        block_n = block_size[0]
        skip = {id(m) for m in exclude}
        by_storage = {m.weight.untyped_storage().data_ptr(): m for m in model.modules()
                      if isinstance(m, Linear) and id(m) not in skip}
        self.parts: dict[str, tuple[Linear, int, Callable | None]] = {}
        for name, (target, transform) in targets.items():
            linear = by_storage.get(target.untyped_storage().data_ptr())
            if (linear is None or not name.endswith(".weight") or target.dim() != 2
                    or target.shape[1] != linear.in_features):
                continue
            offset = (target.storage_offset() - linear.weight.storage_offset()) // \
                linear.in_features
            rows = target.shape[0]
            if (offset % block_n == 0
                    and (rows % block_n == 0 or offset + rows == linear.out_features)
                    and _keeps_tiles(transform, rows, block_n)):
                self.parts[name[:-len(".weight")]] = (linear, offset, transform)
        self._staged: dict[int, list] = {}   # id(linear) -> [linear, codes, scales, rows]

    def stage(self, base: str, codes: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Keep one checkpoint pair (codes [rows, K] float8_e4m3fn, scale_inv [ceil(rows/bn),
        ceil(K/bk)] float32) if it belongs to a planned Linear; a `PairHook`."""
        if base not in self.parts:
            return
        linear, offset, transform = self.parts[base]
        block_n, block_k = self.block_size
        device = linear.weight.device
        entry = self._staged.get(id(linear))
        if entry is None:
            grid = (-(-linear.out_features // block_n), -(-linear.in_features // block_k))
            entry = self._staged[id(linear)] = [
                linear, torch.empty(linear.out_features, linear.in_features,
                                    dtype=torch.float8_e4m3fn, device=device),
                torch.empty(grid, dtype=torch.float32, device=device), 0]
        if transform is not None:   # a row permutation: move the bytes
            codes = transform(codes.view(torch.uint8)).view(torch.float8_e4m3fn)
        rows = codes.shape[0]
        entry[1][offset:offset + rows] = codes.to(device)
        first_tile = offset // block_n
        entry[2][first_tile:first_tile + scale_inv.shape[0]] = scale_inv.to(device)
        entry[3] += rows

    def finish(self) -> int:
        """Swap the codes and scales into every Linear whose rows all arrived as FP8; returns
        how many Linears are FP8 now."""
        kept = 0
        for linear, codes, scales, rows in self._staged.values():
            if rows == linear.out_features:
                linear.weight = nn.Parameter(codes, requires_grad=False)
                linear.weight_scale_inv = scales
                linear.fp8_block_size = self.block_size
                kept += 1
        self._staged.clear()
        return kept
