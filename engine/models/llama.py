"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over a paged KV cache.

The model sees one flattened varlen step: `input_ids` and `positions` of all scheduled tokens,
one KV cache tensor per layer and the step's `AttentionMetadata`. Projections are fused (q/k/v in
one linear, gate/up in one) and filled from HF checkpoint names by `load_weights`. Module names
follow HF's minus the "model." prefix.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.engine.kv_cache.spec import FullAttentionSpec
from deepinfer.engine.models.layers.attention import PagedAttention
from deepinfer.engine.models.layers.decoder import PreNormDecoderLayer
from deepinfer.engine.models.layers.linear import Linear
from deepinfer.engine.models.layers.lm_head import CausalLMLogits
from deepinfer.engine.models.layers.mlp import GatedMLP
from deepinfer.engine.models.layers.rms_norm import RMSNorm
from deepinfer.engine.models.layers.rotary import RotaryEmbedding, rope_parameters
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.fused_linear import AddedRows, add_norm_linear, fold_norm_weight, linear_add
from deepinfer.kernels.settings import DEFAULT, KernelConfig

# HF checkpoint projection -> (our fused parameter, shard)
_FUSED_SHARDS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                 "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
                 "up_proj": ("gate_up_proj", "up")}


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)


class LlamaAttention(nn.Module):
    """qkv_proj.weight: [(H_q + 2 H_kv) * D, hidden] with row blocks q | k | v."""

    def __init__(self, hf_config, dtype: torch.dtype, *, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(hf_config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias, dtype=dtype)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=self.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size]; rope from `RotaryEmbedding.forward`."""
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 kv_size]
        return self.o_proj(self.attend(rope, qkv, kv_cache, attn_metadata))

    def attend(self, rope: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor,
               kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """qkv: [T, q_size + 2 kv_size] -> attention output [T, q_size] (o_proj's input)."""
        # rotate q and k, store k and v in the cache, attend: one kernel at decode on CUDA
        return self.attn.rotary_attend(qkv, rope, kv_cache, attn_metadata)  # [T, q_size]


class LlamaDecoderLayer(PreNormDecoderLayer):
    """With `norms_folded` (set by `LlamaForCausalLM.load_weights` on CUDA) the two RMSNorm
    weights live in qkv_proj / gate_up_proj (`kernels.fused_linear.fold_norm_weight`) and the
    layer runs `forward_folded`; otherwise the pre-norm block of `PreNormDecoderLayer`.
    `kernel_config`: the fused kernels' choices (`layers.set_kernel_config`)."""

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, hf_config, dtype: torch.dtype, *, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(hf_config, dtype, qkv_bias=qkv_bias, o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size,
                            bias=getattr(hf_config, "mlp_bias", False), dtype=dtype)

    def forward_folded(self, rope: tuple[torch.Tensor, torch.Tensor],
                       pending: torch.Tensor | AddedRows | None, residual: torch.Tensor,
                       kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
                       ) -> tuple[torch.Tensor | AddedRows | None, torch.Tensor]:
        """The layer over the stream residual + pending ([T, hidden_size] each; pending None
        or AddedRows when already added), with RMSNorm, SiLU-mul and the residual adds folded
        into the linears where `kernels.fused_linear` runs fused kernels. Returns (pending,
        residual)."""
        attn, mlp, settings = self.self_attn, self.mlp, self.kernel_config
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv, residual = add_norm_linear(pending, residual, norm1.weight, norm1.eps,
                                        attn.qkv_proj.weight, attn.qkv_proj.bias,
                                        settings=settings)
        out = attn.attend(rope, qkv, kv_cache, attn_metadata)   # [T, q_size]
        pending, residual = linear_add(out, attn.o_proj.weight, attn.o_proj.bias, residual,
                                       settings=settings)
        act, residual = add_norm_linear(pending, residual, norm2.weight, norm2.eps,
                                        mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                        gated=True, settings=settings)   # [T, intermediate]
        return linear_add(act, mlp.down_proj.weight, mlp.down_proj.bias, residual,
                          settings=settings)


class LlamaForCausalLM(CausalLMLogits, nn.Module):
    """Llama decoder + LM head. Attributes the runner sizes the KV cache with: num_layers,
    num_kv_heads, head_dim, dtype (and `kv_cache_shape`). `batch_invariant_devices`: where every
    op of its forward has a batch-invariant form (engine/batch_invariant.py)."""

    batch_invariant_devices = ("cpu", "cuda")

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported by the "
                             f"Llama family implementation (it needs 'silu').")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported: every layer here "
                             "attends to the full context. Use a checkpoint without it.")
        self.config, self.dtype = hf_config, dtype
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = (getattr(hf_config, "num_key_value_heads", None)
                             or hf_config.num_attention_heads)
        self.head_dim = _head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        qkv_bias, o_bias = self._attention_biases(hf_config)
        hidden = hf_config.hidden_size
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden, _freeze=True,
                                         _weight=torch.empty(self.vocab_size, hidden,
                                                             dtype=dtype))
        self.rotary_emb = RotaryEmbedding(self.head_dim, hf_config.max_position_embeddings,
                                          rope_parameters(hf_config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, dtype, qkv_bias=qkv_bias, o_bias=o_bias)
            for _ in range(self.num_layers))
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype)
        self.lm_head = Linear(hidden, self.vocab_size, bias=False, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _attention_biases(hf_config) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): Llama's `attention_bias` covers all four projections."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def kv_cache_spec(self, dtype_bytes: int) -> FullAttentionSpec:
        """The per-layer KV layout the runner allocates: K and V per kv-head."""
        return FullAttentionSpec(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One varlen step.

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64, each token's position in its sequence.
            kv_caches: num_layers tensors [2, num_blocks, block_size, num_kv_heads, head_dim]
                of the model dtype; this step's K/V are written into them.
            attn_metadata: the step's varlen batch description.
            inputs_embeds: [num_tokens, hidden_size] input embeddings to use instead of
                `embed_tokens(input_ids)` (a multimodal model's image rows put in place).
        Returns:
            [num_tokens, hidden_size] final-norm hidden states, model dtype.
        """
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        if not isinstance(hidden, torch.Tensor):   # folded layers added their last output
            return self.norm(residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from HF checkpoint tensors, then pack the linears.

        Args:
            weights: (HF name, tensor) pairs, e.g. ("model.layers.0.self_attn.q_proj.weight",
                [H_q * D, hidden]); q/k/v and gate/up are copied into their fused parameters.
        Raises:
            ValueError: an unknown name, a shape mismatch, or a parameter left unfilled.
        """
        params = dict(self.named_parameters())
        filled: set[tuple[str, str]] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb." in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            name, shard = self._fused_target(name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in "
                                 f"{type(self).__name__}; is the checkpoint for this model?")
            self._copy_into(params[name], shard, tensor, hf_name)
            filled.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in self._expected_fills(params)
                         if (n, s) not in filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}; the "
                             f"model would run with uninitialised weights.")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        # on CUDA the decode GEMMs apply the norms; on CPU the GGUF weights keep their exact
        # quantized form (folding would scale them off the Q4_1 / Q8_0 grid)
        if self.embed_tokens.weight.is_cuda and self.dtype in (torch.bfloat16, torch.float16):
            self.fold_norms()

    def fold_norms(self) -> None:
        """Fold each layer's two RMSNorm weights into qkv_proj / gate_up_proj (the norms keep
        all-ones weights) and switch the layers to `LlamaDecoderLayer.forward_folded`. Same
        function, rounded differently (`kernels.fused_linear`). Called once, after loading."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fold_norm_weight(layer.input_layernorm.weight, attn.qkv_proj.weight)
            fold_norm_weight(layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight)
            attn.qkv_proj.pack()
            mlp.gate_up_proj.pack()
            layer.norms_folded = True

    @staticmethod
    def _fused_target(name: str) -> tuple[str, str]:
        """HF parameter name -> (our parameter name, shard) with shard "" for unfused ones."""
        for hf_proj, (fused, shard) in _FUSED_SHARDS.items():
            if f".{hf_proj}." in name:
                return name.replace(f".{hf_proj}.", f".{fused}."), shard
        return name, ""

    def _shard_rows(self, shard: str) -> tuple[int, int]:
        """(first row, row count) of a shard inside its fused parameter."""
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        inter = self.config.intermediate_size
        return {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size),
                "gate": (0, inter), "up": (inter, inter)}[shard]

    def _copy_into(self, param: torch.Tensor, shard: str, tensor: torch.Tensor,
                   hf_name: str) -> None:
        target = param.data if not shard else param.data.narrow(0, *self._shard_rows(shard))
        if target.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}; "
                             f"the model expects {tuple(target.shape)} (config mismatch?).")
        target.copy_(tensor)

    @staticmethod
    def _expected_fills(params: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
        expected = []
        for name in params:
            if ".qkv_proj." in name:
                expected += [(name, "q"), (name, "k"), (name, "v")]
            elif ".gate_up_proj." in name:
                expected += [(name, "gate"), (name, "up")]
            else:
                expected.append((name, ""))
        return expected


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama layout with a bias on q/k/v (none on o)."""

    @staticmethod
    def _attention_biases(hf_config) -> tuple[bool, bool]:
        return True, False
