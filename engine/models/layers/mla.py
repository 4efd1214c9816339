"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434 §2.1): queries come from
`q_proj` or, with `q_lora_rank`, from `q_b_proj(RMSNorm(q_a_proj(h)))`; keys and values from
one latent `c_KV = RMSNorm(kv_a(h)[:kv_lora_rank])` plus a shared rotary key
`k_R = RoPE(kv_a(h)[kv_lora_rank:])`. Only `[c_KV ; k_R]` is cached (`MLAAttentionSpec`);
`kv_b_proj` holds the up-projections W_UK / W_UV, used expanded for prefill and absorbed for
decode (`kernels.mla_attention`). YaRN scaling multiplies the softmax scale by mscale² where
`mscale_all_dim` is set (transformers' `yarn_apply_mscale`).

DeepSeek's rotary dims come in interleaved pairs (x0, x1), (x2, x3), ... At load the rope rows
of the q and kv_a projections are permuted to (x0, x2, ..., x1, x3, ...), so the shared
half-split `apply_rotary` computes the same rotation (transformers' V3 `rope_interleave` output
is exactly this layout; V2's interleaved output differs only by a permutation shared by q and k,
which leaves q·k unchanged). Checkpoints with `rope_interleave: false` are used as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.engine.models.layers.linear import Linear
from deepinfer.engine.models.layers.rms_norm import RMSNorm
from deepinfer.engine.models.layers.rotary import rope_parameters, yarn_get_mscale
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.fused_linear import fold_norm_weight
from deepinfer.kernels.linear import linear
from deepinfer.kernels.mla_attention import rotate_write_and_attend
from deepinfer.kernels.settings import DEFAULT, KernelConfig

# checkpoint name -> (destination tensor, optional transform applied to the checkpoint tensor)
Targets = dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]]
_LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, as in HF


def softmax_scale(hf_config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim)² when set."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        mscale = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def _deinterleave(rope_dim: int) -> torch.Tensor:
    """[rope_dim] int64 permutation: even dims first, then odd dims."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


class MLAAttention(nn.Module):
    """Multi-head Latent Attention. Module names follow HF (`q_a_proj`, `kv_b_proj`, ...).

    kv_b_proj.weight: [H * (Dn + Dv), L], per head Dn rows of W_UK then Dv rows of W_UV.
    `kernel_config`: the MLA kernels' tuning (`layers.set_kernel_config`).
    """

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, hf_config, dtype: torch.dtype, *, interleaved_rope: bool) -> None:
        super().__init__()
        c = hf_config
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (c.qk_nope_head_dim, c.qk_rope_head_dim,
                                                    c.v_head_dim)
        self.q_lora_rank = getattr(c, "q_lora_rank", None)
        bias = bool(getattr(c, "attention_bias", False))
        q_out = self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank:
            self.q_a_proj = Linear(c.hidden_size, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, q_out, bias=False, dtype=dtype)
        else:
            self.q_proj = Linear(c.hidden_size, q_out, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.kv_lora_rank + self.rope_dim,
                                         bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS, dtype)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                bias=False, dtype=dtype)
        self.o_proj = Linear(self.num_heads * self.v_dim, c.hidden_size, bias=bias, dtype=dtype)
        self.scale = softmax_scale(c)
        self.interleaved_rope = interleaved_rope
        self.w_uk: torch.Tensor | None = None  # [H, Dn, L], set by finish_loading
        self.w_uv: torch.Tensor | None = None  # [H, Dv, L]
        # [Q + L + R, hidden]: q_proj's (q_a_proj's) rows, kv_a's (merge_q_kv_a)
        self.q_kv_a_weight: torch.Tensor | None = None

    def _permute_q_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        heads = tensor.view(self.num_heads, self.nope_dim + self.rope_dim, -1)
        rope = heads[:, self.nope_dim:][:, _deinterleave(self.rope_dim)]
        return torch.cat([heads[:, :self.nope_dim], rope], dim=1).reshape(tensor.shape)

    def _permute_kv_a_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        rope = tensor[self.kv_lora_rank:][_deinterleave(self.rope_dim)]
        return torch.cat([tensor[:self.kv_lora_rank], rope])

    def checkpoint_targets(self, prefix: str) -> Targets:
        q_fix = self._permute_q_rows if self.interleaved_rope else None
        kv_fix = self._permute_kv_a_rows if self.interleaved_rope else None
        targets: Targets = {}
        for name, param in self.named_parameters():
            fix = None
            if name.startswith(("q_proj.", "q_b_proj.")):
                fix = q_fix
            elif name.startswith("kv_a_proj_with_mqa."):
                fix = kv_fix
            targets[f"{prefix}{name}"] = (param.data, fix)
        return targets

    def finish_loading(self) -> None:
        """Point W_UK [H, Dn, L] and W_UV [H, Dv, L] at kv_b_proj's rows (views, no copy); the
        attention kernels use them, never kv_b_proj's forward, so its packed copy is dropped.
        On CUDA also `merge_q_kv_a`."""
        per_head = self.kv_b_proj.weight.data.view(self.num_heads, self.nope_dim + self.v_dim,
                                                   self.kv_lora_rank)
        self.w_uk = per_head[:, :self.nope_dim]
        self.w_uv = per_head[:, self.nope_dim:]
        self.kv_b_proj.packed_weight = self.kv_b_proj.quantized_weight = None
        if self.kv_a_proj_with_mqa.weight.is_cuda:   # CPU keeps its packed copies per Linear
            self.merge_q_kv_a()

    def merge_q_kv_a(self) -> bool:
        """Put q_proj's (q_a_proj's) and kv_a_proj_with_mqa's weights in one tensor
        `q_kv_a_weight`, the two Linears' weights its views: one GEMM, one launch less per layer
        at decode. Not for biases or FP8 weights; returns whether the weights are merged."""
        if self.q_kv_a_weight is not None:
            return True
        first, second = self._first_projection(), self.kv_a_proj_with_mqa
        if (first.bias is not None or second.bias is not None
                or first.weight_scale_inv is not None or second.weight_scale_inv is not None):
            return False
        merged = torch.cat([first.weight.data, second.weight.data])
        first.weight.data = merged[:first.out_features]
        second.weight.data = merged[first.out_features:]
        self.q_kv_a_weight = merged
        return True

    def fold_input_norm(self, norm_weight: torch.Tensor) -> None:
        """`kernels.fused_linear.fold_norm_weight` of the input RMSNorm's weight [hidden_size]
        (set to ones) into the merged q + kv_a weight (`merge_q_kv_a` first), then the two
        Linears' packed copies refreshed."""
        fold_norm_weight(norm_weight, self.q_kv_a_weight)
        self._first_projection().pack()
        self.kv_a_proj_with_mqa.pack()

    def _first_projection(self) -> Linear:
        """The projection of the hidden state towards the queries: q_a_proj or q_proj."""
        return self.q_a_proj if self.q_lora_rank else self.q_proj

    def split_q_kv_a(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged GEMM's output [T, Q + L + R] -> (q_proj's (q_a_proj's) [T, Q], kv_a
        [T, L + R]), views."""
        kv_a_rows = self.kv_a_proj_with_mqa.out_features
        first, kv_a = fused.split([fused.shape[1] - kv_a_rows, kv_a_rows], dim=1)
        return first, kv_a

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size] -> (q_proj's (q_a_proj's) output [T, Q], kv_a [T, L + R]),
        views of one GEMM's output where the weights are merged."""
        if self.q_kv_a_weight is not None:
            return self.split_q_kv_a(linear(hidden, self.q_kv_a_weight,
                                            settings=self.kernel_config))
        return self._first_projection()(hidden), self.kv_a_proj_with_mqa(hidden)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size]. kv_cache: [num_blocks, block_size,
        L + R], this step's latents written at attn_metadata.slot_mapping."""
        first, kv_a = self._project(hidden)
        return self.o_proj(self.attend(rope, first, kv_a, kv_cache, attn_metadata))

    def attend(self, rope: tuple[torch.Tensor, torch.Tensor], first: torch.Tensor,
               kv_a: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
               ) -> torch.Tensor:
        """The attention between the first projections and o_proj.

        Args:
            first: [T, Q] q_proj's output (Q = H * (Dn + R)), or q_a_proj's ([T, q_lora_rank]).
            kv_a: [T, L + R] kv_a_proj_with_mqa's output; its latent part is normed by
                kv_a_layernorm and written to kv_cache with the rotated rope part.
        Returns:
            [T, H * Dv], o_proj's input.
        """
        num_tokens = first.shape[0]
        query = self.q_b_proj(self.q_a_layernorm(first)) if self.q_lora_rank else first
        query = query.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        norm = self.kv_a_layernorm
        out = rotate_write_and_attend(  # [T, H, Dv]
            query, kv_a, norm.weight, norm.eps, *rope, kv_cache, attn_metadata, self.w_uk,
            self.w_uv, self.scale, settings=self.kernel_config)
        return out.reshape(num_tokens, self.num_heads * self.v_dim)
