"""Rotary position embedding, Llama / GPT-NeoX style (rotate the two halves of each head).

Supported `rope_type`s: "default", "linear" (positions divided by `factor`), "llama3"
(Llama 3.1's frequency-dependent scaling) and "yarn" (YaRN, arXiv 2309.00071: per-frequency
interpolation ramp plus an attention factor on cos/sin; used by DeepSeek-V2/V3). The cos/sin
table is built once for `max_position_embeddings` positions; each forward step looks it up once
and every layer applies it with `apply_rotary`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.kernels import rotary as kernels_rotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config) -> dict:
    """The config's rope settings as one dict with at least `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`; older configs in `rope_theta` plus an
    optional `rope_scaling` dict (whose type key may be spelled "type").
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / factor, short ones kept, a smooth ramp between."""
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, params: dict) -> torch.Tensor:
    """YaRN "NTK-by-parts": frequencies below the correction range are divided by `factor`,
    those above kept, a linear ramp between (as transformers' `_compute_yarn_parameters`)."""
    base, factor = float(params["rope_theta"]), params["factor"]
    original_max = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    return inv_freq / factor * (1 - extrapolation_factor) + inv_freq * extrapolation_factor


def rotary_attention_factor(params: dict) -> float:
    """The factor cos and sin are multiplied by: YaRN's `attention_factor` (given, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor)); 1 otherwise."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale = params["factor"], params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """[head_dim // 2] float32 rotation frequencies for `params` (see `rope_parameters`)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; deepinfer implements "
                         f"{SUPPORTED_ROPE_TYPES}. Use a model with one of those.")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, params)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; `forward(positions)` returns what `apply_rotary` needs."""

    def __init__(self, head_dim: int, max_position: int, params: dict) -> None:
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        inv_freq = inverse_frequencies(head_dim, params)  # [D/2]
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq  # [P, D/2]
        attention_factor = rotary_attention_factor(params)  # YaRN; 1.0 for the others
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        # [P, 2, D]: row 0 = (cos, cos); row 1 = (-sin, sin), the sign of rotate_half folded in
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            positions: [num_tokens] int64, each < max_position.
            dtype: the activations' dtype.
        Returns:
            (cos, signed_sin), each [num_tokens, 1, head_dim] in `dtype`.
        """
        cos_sin = self.cos_sin.index_select(0, positions).to(dtype)  # [T, 2, D]
        return cos_sin[:, 0:1], cos_sin[:, 1:2]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of `x`: x * cos + rotate_half(x) * sin.

    Args:
        x: [num_tokens, num_heads, head_dim] (a strided view of a fused projection is fine).
        cos, signed_sin: [num_tokens, 1, head_dim] from `RotaryEmbedding.forward`.
    Returns:
        [num_tokens, num_heads, head_dim], a new contiguous tensor of x's dtype.
    `kernels.rotary` (backend "auto"): one Triton kernel on CUDA, the torch reference elsewhere.
    """
    return kernels_rotary.apply_rotary(x, cos, signed_sin)
