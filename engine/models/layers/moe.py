"""`MoE`: router + routed experts of a Mixture-of-Experts layer, experts addressed through a
logical -> physical map.

The router picks *logical* experts (the checkpoint's expert numbers); `logical_to_physical`
turns them into rows of the physical weight tensors. Today the map is the identity and there is
one physical copy per expert; expert parallelism and EPLB (replicas of hot experts, placement
across ranks) will change the map and the physical tensors, not the model code.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.moe.gating import RoutingConfig, route_hidden
from deepinfer.kernels.moe import moe_experts
from deepinfer.kernels.settings import DEFAULT, KernelConfig


class MoE(nn.Module):
    """Parameters (HF checkpoint names in brackets, e expert number):
        gate_weight: [num_experts, hidden_size] float32 ([mlp.gate.weight]).
        e_score_correction_bias: [num_experts] float32 ([mlp.gate.e_score_correction_bias]),
            only with topk_method "noaux_tc".
        w13: [num_physical_experts, 2 * moe_intermediate_size, hidden_size]
            ([experts.e.gate_proj.weight] rows then [experts.e.up_proj.weight] rows).
        w2: [num_physical_experts, hidden_size, moe_intermediate_size]
            ([experts.e.down_proj.weight]).
        With `fp8_block` (an FP8 block-scaled checkpoint kept in FP8), w13 / w2 are
        float8_e4m3fn and `w13_scale` / `w2_scale` hold their float32 block scales
        ([E, 2I / block, H / block] and [E, H / block, I / block]; the checkpoint's
        [experts.e.*_proj.weight_scale_inv] tiles, see `expert_scale`).
    Buffers:
        logical_to_physical: [num_experts] int64, identity for now.

    The forward never reads a value back to the host (routing, alignment and the expert GEMMs
    stay on the device with the "triton" backend), so CUDA graphs can hold it.
    """

    kernel_config: KernelConfig = DEFAULT  # set by `layers.set_kernel_config`

    def __init__(self, hidden_size: int, moe_intermediate_size: int, routing: RoutingConfig,
                 dtype: torch.dtype, *, backend: str = "auto",
                 fp8_block: int | None = None) -> None:
        super().__init__()
        num_experts = routing.num_experts
        self.routing, self.backend = routing, backend
        self.dtype = dtype   # the compute dtype (the experts' storage may be FP8)
        self.intermediate_size = moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size,
                                                    dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if routing.topk_method == "noaux_tc" else None)
        storage = torch.float8_e4m3fn if fp8_block else dtype
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * moe_intermediate_size, hidden_size,
                                            dtype=storage), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, moe_intermediate_size,
                                           dtype=storage), requires_grad=False)
        self.register_buffer("logical_to_physical", torch.arange(num_experts), persistent=False)
        # FP8 experts (`fp8_block`, `quantize_experts_fp8`): [E, rows / block, cols / block]
        # float32 block scales
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        if fp8_block:
            if moe_intermediate_size % fp8_block or hidden_size % fp8_block:
                raise ValueError(f"FP8 experts need hidden_size ({hidden_size}) and "
                                 f"moe_intermediate_size ({moe_intermediate_size}) that are "
                                 f"multiples of the {fp8_block}-wide scale blocks.")
            self.w13_scale = torch.empty(num_experts, 2 * moe_intermediate_size // fp8_block,
                                         hidden_size // fp8_block, dtype=torch.float32)
            self.w2_scale = torch.empty(num_experts, hidden_size // fp8_block,
                                        moe_intermediate_size // fp8_block, dtype=torch.float32)
        # engine/moe/expert_parallel.py: this layer's slice of the experts over the EP ranks,
        # its replicas and load counter (None: all experts here, no EP)
        self.expert_parallel = None

    @torch.no_grad()
    def quantize_experts_fp8(self, block: int = 128) -> None:
        """Keep w13 / w2 in float8_e4m3fn with `block` x `block` scales (amax / 448 per block,
        DeepSeek-V3's `weight_scale_inv` layout), halving the experts' bytes; the forward then
        runs the FP8 grouped GEMMs (Triton) or dequantizes (other backends).

        Raises:
            ValueError: an expert dimension is not a multiple of `block`.
        """
        for name in ("w13", "w2"):
            weight = getattr(self, name).data
            experts, rows, cols = weight.shape
            if rows % block or cols % block:
                raise ValueError(f"{name} {tuple(weight.shape)}: FP8 experts need dimensions "
                                 f"that are multiples of {block}.")
            blocks = weight.float().view(experts, rows // block, block, cols // block, block)
            scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
            quantized = (blocks / scale[:, :, None, :, None]).clamp(-448, 448)
            setattr(self, name, nn.Parameter(quantized.view(experts, rows, cols).to(
                torch.float8_e4m3fn), requires_grad=False))
            setattr(self, f"{name}_scale", scale.contiguous())

    def expert_weight(self, logical_expert: int, projection: str) -> torch.Tensor:
        """The physical weight slice an HF expert tensor loads into.

        Args:
            logical_expert: the checkpoint's expert number.
            projection: "gate_proj" | "up_proj" ([I, hidden]) or "down_proj" ([hidden, I]).
        """
        return self._expert_slice(self.w13.data, self.w2.data, logical_expert, projection)

    def expert_scale(self, logical_expert: int, projection: str) -> torch.Tensor:
        """FP8 experts: the block-scale slice an HF `weight_scale_inv` loads into
        ([I / block, H / block] for gate_proj / up_proj, [H / block, I / block] for
        down_proj, float32).

        Raises:
            ValueError: the experts are not FP8, or an unknown projection.
        """
        if self.w13_scale is None:
            raise ValueError("this MoE holds its experts in the compute dtype, not FP8")
        return self._expert_slice(self.w13_scale, self.w2_scale, logical_expert, projection)

    def _expert_slice(self, w13: torch.Tensor, w2: torch.Tensor, logical_expert: int,
                      projection: str) -> torch.Tensor:
        """`projection`'s part of the physical slot of `logical_expert` in the per-slot
        tensors w13 (gate rows, then as many up rows) and w2."""
        physical = int(self.logical_to_physical[logical_expert])
        half = w13.shape[1] // 2
        if projection == "gate_proj":
            return w13[physical, :half]
        if projection == "up_proj":
            return w13[physical, half:]
        if projection == "down_proj":
            return w2[physical]
        raise ValueError(f"unknown expert projection {projection!r}")

    def forward(self, hidden: torch.Tensor, shared_output: torch.Tensor | None = None,
                shared_ready: torch.cuda.Event | None = None) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> routed experts' weighted sum (plus
        `shared_output`, [num_tokens, hidden_size] or None: added by the experts' combine
        kernel on the Triton backend), same shape/dtype. `shared_ready`: None, or the event
        after which shared_output (written on another CUDA stream) may be read
        (`kernels.moe.moe_experts`)."""
        if self.expert_parallel is not None:
            out = self.expert_parallel.forward(self, hidden)
            if shared_ready is not None:
                torch.cuda.current_stream(hidden.device).wait_event(shared_ready)
            return out if shared_output is None else out + shared_output
        topk_weights, physical_ids = route_hidden(  # [T, top_k] each
            hidden, self.gate_weight, self.routing, self.e_score_correction_bias,
            logical_to_physical=self.logical_to_physical, settings=self.kernel_config)
        return moe_experts(hidden, self.w13, self.w2, topk_weights, physical_ids,
                           backend=self.backend, settings=self.kernel_config,
                           w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                           shared_output=shared_output, shared_ready=shared_ready)

    def extra_repr(self) -> str:
        return (f"num_experts={self.routing.num_experts}, top_k={self.routing.top_k}, "
                f"topk_method={self.routing.topk_method!r}, backend={self.backend!r}")
