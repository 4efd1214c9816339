"""Public MoE expert computation `moe_experts`, dispatched to a backend.

Backends, imported lazily on first use:
- "reference": `kernels/reference/moe.py`, a loop over all experts with index_select (the oracle).
- "torch": `kernels/moe_torch.py`, (token, k) pairs sorted by expert, one GEMM pair per hit
  expert on a contiguous slice (reads the per-expert counts on the host: not graph-safe).
- "triton": `kernels/moe_triton.py`, on-device alignment + grouped GEMMs (gate_up with
  SiLU-and-mul fused, down with the routing weights) + combine; no host sync, CUDA-graph safe.
- "deep_gemm": `kernels/moe_deep_gemm.py`, DeepGEMM's contiguous grouped bf16 GEMM where the
  user installed `deep_gemm` (optional, never required).
`backend="auto"` is "triton" on CUDA where Triton is installed (or "deep_gemm" for bf16 calls of
at least `KernelConfig.moe_deep_gemm_min_rows` mean rows per expert where deep_gemm is
installed), else "torch".

Expert weights are addressed by *physical* expert index (the model maps logical → physical
before calling), so replicated or re-placed experts (EPLB) need no change here.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.backends import Backends, triton_available
from deepinfer.kernels.settings import DEFAULT, KernelConfig


def _auto_backend(device: torch.device) -> str:
    """"triton" on CUDA where Triton is installed, else "torch"."""
    return "triton" if device.type == "cuda" and triton_available() else "torch"


_BACKENDS = Backends("MoE", {"reference": "deepinfer.kernels.reference.moe",
                             "torch": "deepinfer.kernels.moe_torch",
                             "triton": "deepinfer.kernels.moe_triton",
                             "deep_gemm": "deepinfer.kernels.moe_deep_gemm"}, auto=_auto_backend)
BACKENDS = _BACKENDS.names


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend name `backend` means on `device` ("auto" resolved)."""
    return _BACKENDS.resolve(backend, device)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      block: int = 128) -> torch.Tensor:
    """[E, N, K] FP8 weight times its [E, ceil(N / block), ceil(K / block)] block scales, in
    `dtype` (the FP8 experts' oracle, and their path on backends without FP8 GEMMs)."""
    n, k = weight.shape[-2:]
    full = scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)
    return (weight.float() * full[..., :k]).to(dtype)


def moe_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                backend: str = "auto", settings: KernelConfig = DEFAULT, *,
                w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None,
                shared_output: torch.Tensor | None = None,
                shared_ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """Each token's routing-weighted sum of its top-k SwiGLU experts (plus `shared_output`).

    Args:
        hidden: [num_tokens, hidden_size].
        w13: [num_physical_experts, 2 * intermediate_size, hidden_size], hidden's dtype (gate
            rows then up rows).
        w2: [num_physical_experts, hidden_size, intermediate_size] (down projection).
        topk_weights: [num_tokens, top_k] float32.
        topk_ids: [num_tokens, top_k] int64 (or int32) physical expert ids, each <
            num_physical_experts.
        backend: "auto", "reference", "torch", "triton" or "deep_gemm".
        settings: kernel choices (the Triton backend's tile table `moe_tiles`).
        w13_scale, w2_scale: FP8 experts: w13 / w2 in float8_e4m3fn with these float32 128x128
            block scales ([E, 2I / 128, H / 128], [E, H / 128, I / 128]); the Triton backend
            runs FP8 GEMMs, the others dequantize to hidden's dtype first.
        shared_output: [num_tokens, hidden_size] hidden's dtype or None: added to the result
            (the shared experts' output; the Triton backend adds it in its combine kernel, in
            float32 before the one rounding).
        shared_ready: None, or (CUDA) an event recorded on the stream that writes
            shared_output after its kernels: the current stream waits for it just before
            shared_output is read (the Triton backend: before its combine kernel), so the
            shared experts may run on another stream concurrently with the routed ones.
    Returns:
        [num_tokens, hidden_size], hidden's dtype (sums accumulated in float32).
    """
    name = _BACKENDS.resolve(backend, hidden.device)
    if (backend == "auto" and name == "triton" and hidden.dtype == torch.bfloat16
            and not settings.batch_invariant and w13_scale is None   # its GEMM is bf16
            and topk_ids.numel() >= settings.moe_deep_gemm_min_rows * w13.shape[0]
            and _BACKENDS.load("deep_gemm").available()):
        name = "deep_gemm"
    if name == "triton":
        return _BACKENDS.load(name).moe_experts(hidden, w13, w2, topk_weights, topk_ids,
                                                w13_scale=w13_scale, w2_scale=w2_scale,
                                                shared_output=shared_output,
                                                shared_ready=shared_ready, settings=settings)
    if w13_scale is not None:
        w13 = dequantize_blocks(w13, w13_scale, hidden.dtype)
        w2 = dequantize_blocks(w2, w2_scale, hidden.dtype)
    experts = _BACKENDS.load(name)
    if name == "deep_gemm":
        out = experts.moe_experts(hidden, w13, w2, topk_weights, topk_ids, settings=settings)
    else:
        out = experts.moe_experts(hidden, w13, w2, topk_weights, topk_ids)
    if shared_ready is not None:
        torch.cuda.current_stream(hidden.device).wait_event(shared_ready)
    return out if shared_output is None else out + shared_output
