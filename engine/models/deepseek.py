"""DeepSeek-V2 / V3 decoder over a paged latent KV cache: MLA, DeepSeekMoE, MTP, FP8 weights.

- Multi-head Latent Attention (`layers/mla.py`): queries and one cached latent per token.
- DeepSeekMoE (V2 §2.2, V3 §2.1.2): layers `i >= first_k_dense_replace` with
  `i % moe_layer_freq == 0` use shared experts plus routed experts picked by
  `engine.moe.gating` (greedy / group_limited_greedy / noaux_tc, softmax or sigmoid scores).
- Multi-Token Prediction (V3 §2.2): the checkpoint's layer `num_hidden_layers + k` is MTP module
  k; `mtp_forward` gives draft logits for the token after next.
- FP8 block-scaled checkpoints (V3 §3.3): on devices with the FP8 GEMM the routed experts stay
  FP8 with their 128 x 128 scales (the grouped FP8 GEMMs of `kernels.moe_triton`), and with
  `KernelConfig.fp8_block_gemm` the attention / dense MLP / shared-expert linears too;
  everything else (and every weight on CPU) is dequantized at load (`engine.models.fp8`).
- Decode fusions (`kernels.fused_linear`, as Llama's; CUDA bf16 / fp16 with plain q and kv_a
  weights): each layer's input RMSNorm weight is folded into the merged q + kv_a GEMM, which
  applies the norm; o_proj and the MLPs' down projections (on MoE layers the shared experts')
  add their output into the residual stream in their epilogue. Each runs fused where the
  device's sweep file says it is faster (`benchmarks/fused_linear_sweep.py --model
  deepseek-v2-lite`), else as the unfused ops. The post-attention RMSNorm stays a kernel: it
  feeds the router and the experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from deepinfer.engine.kv_cache.spec import MLAAttentionSpec
from deepinfer.engine.models.fp8 import (WEIGHT_SCALE_SUFFIX, Fp8LinearStaging,
                                         dequantize_fp8_weights, fp8_block_size,
                                         fp8_expert_block)
from deepinfer.engine.models.layers.decoder import PreNormDecoderLayer
from deepinfer.engine.models.layers.linear import Linear
from deepinfer.engine.models.layers.lm_head import CausalLMLogits
from deepinfer.engine.models.layers.mla import MLAAttention, Targets
from deepinfer.engine.models.layers.mlp import GatedMLP
from deepinfer.engine.models.layers.moe import MoE
from deepinfer.engine.models.layers.rms_norm import RMSNorm
from deepinfer.engine.models.layers.rotary import RotaryEmbedding, rope_parameters
from deepinfer.engine.moe.gating import RoutingConfig
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.fp8 import fp8_supported
from deepinfer.kernels.fused_linear import AddedRows, add_norm_linear
from deepinfer.kernels.settings import DEFAULT, KernelConfig



def _gated_mlp_targets(mlp: GatedMLP, prefix: str) -> Targets:
    """HF gate/up/down names -> rows of the fused gate_up_proj and the down projection."""
    gate_up, size = mlp.gate_up_proj.weight.data, mlp.intermediate_size
    return {f"{prefix}gate_proj.weight": (gate_up[:size], None),
            f"{prefix}up_proj.weight": (gate_up[size:], None),
            f"{prefix}down_proj.weight": (mlp.down_proj.weight.data, None)}


@functools.cache
def _shared_experts_stream(device: torch.device) -> torch.cuda.Stream:
    """The second CUDA stream the shared experts of decode-sized MoE calls run on."""
    return torch.cuda.Stream(device)


class DeepseekMoEBlock(nn.Module):
    """Shared experts (one SwiGLU MLP of n_shared_experts * moe_intermediate_size) plus routed
    experts (`layers.moe.MoE`); the two outputs are summed.

    On CUDA, up to `KernelConfig.moe_shared_stream_max_rows` tokens, the shared experts run on
    a second stream, concurrently with the router, the alignment and the routed expert GEMMs
    (SGLang's dual-stream MoE): at decode each of these kernels is a few microseconds of
    launch and ramp on a few SMs, so the two chains overlap instead of adding up. The combine
    waits for them (an event, captured into CUDA graphs as a dependency).
    `kernel_config`: set by `layers.set_kernel_config`.
    """

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, hf_config, routing: RoutingConfig, dtype: torch.dtype, *,
                 expert_fp8_block: int | None = None) -> None:
        super().__init__()
        c = hf_config
        self.moe = MoE(c.hidden_size, c.moe_intermediate_size, routing, dtype,
                       fp8_block=expert_fp8_block)
        num_shared = getattr(c, "n_shared_experts", None) or 0
        self.shared_experts = (GatedMLP(c.hidden_size, c.moe_intermediate_size * num_shared,
                                        bias=False, dtype=dtype) if num_shared else None)

    def checkpoint_targets(self, prefix: str) -> Targets:
        targets: Targets = {f"{prefix}gate.weight": (self.moe.gate_weight.data, None)}
        if self.moe.e_score_correction_bias is not None:
            targets[f"{prefix}gate.e_score_correction_bias"] = (
                self.moe.e_score_correction_bias.data, None)
        for expert in range(self.moe.routing.num_experts):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                name = f"{prefix}experts.{expert}.{projection}"
                targets[f"{name}.weight"] = (self.moe.expert_weight(expert, projection), None)
                if self.moe.w13_scale is not None:   # FP8 experts: codes and scales as stored
                    targets[f"{name}{WEIGHT_SCALE_SUFFIX}"] = (
                        self.moe.expert_scale(expert, projection), None)
        if self.shared_experts is not None:
            targets.update(_gated_mlp_targets(self.shared_experts, f"{prefix}shared_experts."))
        return targets

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden_size] -> [T, hidden_size]."""
        if self.shared_experts is None:
            return self.moe(hidden)
        return self._routed_plus(hidden, self.shared_experts)

    def forward_add(self, hidden: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The block's output added to the residual stream where that saves a kernel.

        The shared experts' down projection runs `Linear.forward_add`: where it runs fused it
        adds the shared output into the stream, the routed experts' combine then adds onto the
        stream, and the next layer's first norm finds nothing pending (it takes the sums of
        squares from the stream: the combine changed it after the down projection wrote them).

        Args:
            hidden: [T, hidden_size] the normed input.
            residual: [T, hidden_size] the residual stream (overwritten where fused).
        Returns:
            (None, the stream with this block's output added) or (the block's output, residual).
        """
        if self.shared_experts is None:
            return self.moe(hidden), residual
        pending = None

        def shared_into_stream(x: torch.Tensor) -> torch.Tensor:
            nonlocal pending
            pending, stream = self.shared_experts.forward_add(x, residual)
            return pending if isinstance(pending, torch.Tensor) else stream

        out = self._routed_plus(hidden, shared_into_stream)
        return (out, residual) if isinstance(pending, torch.Tensor) else (None, out)

    def _routed_plus(self, hidden: torch.Tensor,
                     shared: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed experts' output plus `shared(hidden)` [T, hidden_size], added by the
        combine kernel (no separate add). `shared` runs first, or, up to
        `moe_shared_stream_max_rows` CUDA tokens, on the second stream."""
        if not (hidden.is_cuda
                and hidden.shape[0] <= self.kernel_config.moe_shared_stream_max_rows):
            return self.moe(hidden, shared(hidden))
        main = torch.cuda.current_stream(hidden.device)
        side = _shared_experts_stream(hidden.device)
        # the side stream starts after hidden (and the residual stream) are written; main reads
        # the shared output only after the event, and everything main does later (freeing or
        # reusing hidden's and the output's memory included) comes after it, as does the side
        # stream's next layer (this wait)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared_output = shared(hidden)
            shared_ready = side.record_event()
        return self.moe(hidden, shared_output, shared_ready)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    """With `norms_folded` (set by `DeepseekForCausalLM.fold_norms`) the input RMSNorm's weight
    lives in the merged q + kv_a projection and the layer runs `forward_folded`; otherwise the
    pre-norm block of `PreNormDecoderLayer`. `kernel_config`: the fused kernels' choices
    (`layers.set_kernel_config`)."""

    kernel_config: KernelConfig = DEFAULT

    def __init__(self, hf_config, layer_idx: int, routing: RoutingConfig | None,
                 dtype: torch.dtype, *, interleaved_rope: bool,
                 expert_fp8_block: int | None = None) -> None:
        super().__init__()
        c = hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = MLAAttention(c, dtype, interleaved_rope=interleaved_rope)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        freq = getattr(c, "moe_layer_freq", None) or 1
        is_moe = (routing is not None and layer_idx >= (c.first_k_dense_replace or 0)
                  and layer_idx % freq == 0)
        self.mlp = (DeepseekMoEBlock(c, routing, dtype, expert_fp8_block=expert_fp8_block)
                    if is_moe else
                    GatedMLP(c.hidden_size, c.intermediate_size, bias=False, dtype=dtype))

    def forward_folded(self, rope: tuple[torch.Tensor, torch.Tensor],
                       pending: torch.Tensor | AddedRows | None, residual: torch.Tensor,
                       kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
                       ) -> tuple[torch.Tensor | AddedRows | None, torch.Tensor]:
        """The layer over the stream residual + pending ([T, hidden_size] each; pending None
        or AddedRows when already added): the input RMSNorm in the merged q + kv_a GEMM and the
        residual adds in o_proj's and the MLP's last GEMM where `kernels.fused_linear` runs
        fused kernels. The post-attention RMSNorm stays a kernel of its own (with the add
        still pending, if any): it feeds the router and the experts, which are not such GEMMs.
        Returns (pending, residual)."""
        attn, norm1, norm2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        fused, residual = add_norm_linear(pending, residual, norm1.weight, norm1.eps,
                                          attn.q_kv_a_weight, settings=self.kernel_config)
        out = attn.attend(rope, *attn.split_q_kv_a(fused), kv_cache, attn_metadata)
        pending, residual = attn.o_proj.forward_add(out, residual)
        if isinstance(pending, torch.Tensor):
            hidden, residual = norm2(pending, residual)
        else:
            hidden = norm2(residual)
        return self.mlp.forward_add(hidden, residual)

    def checkpoint_targets(self, prefix: str) -> Targets:
        targets = self.self_attn.checkpoint_targets(f"{prefix}self_attn.")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{prefix}{norm}.weight"] = (getattr(self, norm).weight.data, None)
        if isinstance(self.mlp, GatedMLP):
            targets.update(_gated_mlp_targets(self.mlp, f"{prefix}mlp."))
        else:
            targets.update(self.mlp.checkpoint_targets(f"{prefix}mlp."))
        return targets


class DeepseekMTPLayer(nn.Module):
    """One Multi-Token Prediction module (DeepSeek-V3 §2.2): `h' = eh_proj([enorm(Emb(t));
    hnorm(h)])`, then a full decoder block, then the shared output head behind
    `shared_head.norm`. Embedding and output head are the main model's (shared, as in the
    report); checkpoints carry duplicate copies under this layer, which are skipped."""

    def __init__(self, hf_config, layer_idx: int, routing: RoutingConfig | None,
                 dtype: torch.dtype, *, interleaved_rope: bool,
                 expert_fp8_block: int | None = None) -> None:
        super().__init__()
        c = hf_config
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, bias=False, dtype=dtype)
        self.block = DeepseekDecoderLayer(c, layer_idx, routing, dtype,
                                          interleaved_rope=interleaved_rope,
                                          expert_fp8_block=expert_fp8_block)
        self.shared_head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)

    def checkpoint_targets(self, prefix: str) -> Targets:
        targets = self.block.checkpoint_targets(prefix)
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            module, _ = name.split(".")
            targets[f"{prefix}{name}"] = (getattr(self, module).weight.data, None)
        targets[f"{prefix}shared_head.norm.weight"] = (self.shared_head_norm.weight.data, None)
        return targets

    def forward(self, embeds: torch.Tensor, hidden_states: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """embeds, hidden_states: [T, hidden_size] -> block output [T, hidden_size] (before
        shared_head.norm)."""
        projected = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], -1))
        out, residual = self.block(rope, projected, None, kv_cache, attn_metadata)
        return out + residual


def _routing_config(hf_config, scoring_func: str, topk_method: str) -> RoutingConfig | None:
    """The config's routing knobs (None for a model without routed experts); `scoring_func` and
    `topk_method` are the architecture's defaults for configs that omit them."""
    c = hf_config
    if not getattr(c, "n_routed_experts", None):
        return None
    return RoutingConfig(
        num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
        scoring_func=getattr(c, "scoring_func", None) or scoring_func,
        topk_method=getattr(c, "topk_method", None) or topk_method,
        n_group=getattr(c, "n_group", None) or 1, topk_group=getattr(c, "topk_group", None) or 1,
        norm_topk_prob=bool(getattr(c, "norm_topk_prob", False)),
        routed_scaling_factor=float(getattr(c, "routed_scaling_factor", None) or 1.0))


class DeepseekForCausalLM(CausalLMLogits, nn.Module):
    """DeepSeek decoder + LM head (+ MTP modules when the checkpoint has them).

    Attributes: num_hidden_layers (decoder layers), num_layers (KV cache layers: decoder + MTP),
    num_mtp_layers, vocab_size, dtype, config.
    """

    # decode reads nothing back to the host on CUDA (MoE: routing and the Triton experts on the
    # device; MLA: the torch decode path's graph-safe write and masks), so graphs capture it
    # the MLA and MoE kernels' batch-invariant forms are Triton's (engine/batch_invariant.py)
    batch_invariant_devices = ("cuda",)
    supports_cuda_graphs = True
    # `layers.set_kernel_config` (engine/loader.py, before the weights load): fp8_block_gemm
    # decides whether FP8 checkpoints keep their linears in FP8
    kernel_config: KernelConfig = DEFAULT

    default_scoring_func = "softmax"
    default_topk_method = "greedy"
    interleaved_rope_default = True

    def __init__(self, hf_config, dtype: torch.dtype, *, fp8_experts: bool | None = None
                 ) -> None:
        """`fp8_experts`: keep an FP8 block-scaled checkpoint's routed experts in FP8 (codes
        and scales as stored, half the bytes of bf16); None (default) does where
        `engine.models.fp8.fp8_expert_block` allows it on the device the model is built on
        (the `torch.device` context of `loader.load_model`). Other weights follow
        `kernel_config.fp8_block_gemm` (`load_weights`).

        Raises:
            ValueError: an unsupported activation or MLP bias; `fp8_experts=True` for a
                checkpoint whose experts cannot stay FP8.
        """
        super().__init__()
        c = hf_config
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={c.hidden_act!r} is not supported by the DeepSeek "
                             f"implementation (it needs 'silu').")
        if getattr(c, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported for DeepSeek models.")
        self.config, self.dtype = c, dtype
        self.vocab_size, self.num_hidden_layers = c.vocab_size, c.num_hidden_layers
        interleaved = bool(getattr(c, "rope_interleave", self.interleaved_rope_default))
        routing = _routing_config(c, self.default_scoring_func, self.default_topk_method)
        expert_block = fp8_expert_block(c, torch.get_default_device(), fp8_experts)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _freeze=True,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size,
                                                             dtype=dtype))
        self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.max_position_embeddings,
                                          rope_parameters(c))
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(c, i, routing, dtype, interleaved_rope=interleaved,
                                 expert_fp8_block=expert_block)
            for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        num_mtp = getattr(c, "num_nextn_predict_layers", None) or 0
        self.mtp = nn.ModuleList(  # dropped at load if the checkpoint carries no MTP weights
            DeepseekMTPLayer(c, c.num_hidden_layers + k, routing, dtype,
                             interleaved_rope=interleaved, expert_fp8_block=expert_block)
            for k in range(num_mtp))

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers + self.num_mtp_layers

    def kv_cache_spec(self, dtype_bytes: int) -> MLAAttentionSpec:
        """One latent vector of kv_lora_rank + qk_rope_head_dim values per token and layer
        (decoder layers, then MTP layers)."""
        return MLAAttentionSpec(self.num_layers, self.config.kv_lora_rank,
                                self.config.qk_rope_head_dim, dtype_bytes)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata
                ) -> torch.Tensor:
        """One varlen step.

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64.
            kv_caches: num_layers tensors [num_blocks, block_size, kv_lora_rank +
                qk_rope_head_dim] of the model dtype; the first num_hidden_layers are used here.
            attn_metadata: the step's varlen batch description.
        Returns:
            [num_tokens, hidden_size] final-norm hidden states, model dtype.
        """
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches[:self.num_hidden_layers], strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        if not isinstance(hidden, torch.Tensor):   # folded layers added their last output
            return self.norm(residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def mtp_forward(self, hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                    positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    attn_metadata: AttentionMetadata, *, depth: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module `depth`: draft logits for the token after `next_token_ids`.

        Row j combines the previous hidden state at position p (the main model's `forward`
        output for depth 0, the previous MTP module's returned hidden otherwise) with the
        embedding of the token at p + 1; the module's attention caches its latent at p in
        `kv_caches[num_hidden_layers + depth]` through attn_metadata (built for `positions`).

        Args:
            hidden_states: [T, hidden_size], model dtype.
            next_token_ids: [T] int64, the token following each row's position.
            positions: [T] int64, the positions of hidden_states' rows.
            kv_caches, attn_metadata: as for `forward`.
        Returns:
            (draft logits [T, vocab_size] float32, hidden [T, hidden_size] before
            shared_head.norm, for the next MTP depth).
        Raises:
            ValueError: the checkpoint has no MTP module `depth`.
        """
        if depth >= self.num_mtp_layers:
            raise ValueError(f"MTP depth {depth} requested but the checkpoint has "
                             f"{self.num_mtp_layers} MTP modules (num_nextn_predict_layers).")
        layer = self.mtp[depth]
        rope = self.rotary_emb(positions, hidden_states.dtype)
        hidden = layer(self.embed_tokens(next_token_ids), hidden_states, rope,
                       kv_caches[self.num_hidden_layers + depth], attn_metadata)
        return self.compute_logits(layer.shared_head_norm(hidden)), hidden

    def checkpoint_targets(self) -> Targets:
        """Every checkpoint tensor name this model loads -> where it goes."""
        targets: Targets = {"model.embed_tokens.weight": (self.embed_tokens.weight.data, None),
                            "model.norm.weight": (self.norm.weight.data, None)}
        if not self.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight.data, None)
        for i, layer in enumerate(self.layers):
            targets.update(layer.checkpoint_targets(f"model.layers.{i}."))
        for k, mtp in enumerate(self.mtp):
            targets.update(mtp.checkpoint_targets(f"model.layers.{self.num_hidden_layers + k}."))
        return targets

    def _is_skipped(self, name: str) -> bool:
        """Checkpoint tensors deliberately not loaded: rotary buffers, the MTP layers' duplicate
        embedding / output head, and MTP layers beyond those this model builds."""
        if "rotary_emb." in name or (name == "lm_head.weight" and self.tie_word_embeddings):
            return True
        if not name.startswith("model.layers."):
            return False
        layer_idx = int(name.split(".")[2])
        if layer_idx < self.num_hidden_layers:
            return False
        return (layer_idx >= self.num_layers
                or name.endswith((".embed_tokens.weight", ".shared_head.head.weight")))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     keep_fp8: bool | None = None) -> None:
        """Fill the parameters from HF checkpoint tensors, drop the MTP modules if the
        checkpoint has none, then prepare the linears and MLA's W_UK / W_UV.

        FP8 block-scaled tensors are dequantized to the model dtype, except the routed
        experts of a model built with FP8 experts (`fp8_experts`), whose codes and
        `weight_scale_inv` tiles are copied as stored; with `keep_fp8` (default:
        `kernel_config.fp8_block_gemm` where `kernels.fp8.fp8_supported` says the device runs
        the FP8 GEMM) the linears that can stay FP8 get their codes and scales back afterwards
        (`Fp8LinearStaging`).

        Raises:
            ValueError: an unknown name, a shape mismatch, an FP8 expert stored unquantized,
                or a tensor left unfilled.
        """
        block_size = fp8_block_size(self.config)
        targets = self.checkpoint_targets()
        staging = None
        if block_size is not None:
            kept_codes = {name[:-len(".weight")] for name, (target, _) in targets.items()
                          if target.dtype == torch.float8_e4m3fn}
            if keep_fp8 is None:
                keep_fp8 = (self.kernel_config.fp8_block_gemm
                            and fp8_supported(self.embed_tokens.weight.device))
            if keep_fp8:
                exclude = [self.lm_head] + [m.kv_b_proj for m in self.modules()
                                            if isinstance(m, MLAAttention)]
                staging = Fp8LinearStaging(self, targets, block_size, exclude)
            weights = dequantize_fp8_weights(weights, block_size, self.dtype,
                                             staging.stage if staging else None, kept_codes)
        filled: set[str] = set()
        for name, tensor in weights:
            if self._is_skipped(name):
                continue
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}; is the checkpoint for this model?")
            target, transform = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
                                 f"the model expects {tuple(target.shape)} (config mismatch?).")
            if target.dtype == torch.float8_e4m3fn and tensor.dtype != target.dtype:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, but the model "
                                 "keeps its routed experts in FP8 and needs float8_e4m3fn codes "
                                 "with their weight_scale_inv; build it with fp8_experts=False "
                                 "to load a partly quantized checkpoint.")
            target.copy_(transform(tensor) if transform else tensor)
            filled.add(name)
        first_mtp = f"model.layers.{self.num_hidden_layers}."
        if self.mtp and not any(name.startswith(first_mtp) for name in filled):
            self.mtp = nn.ModuleList()  # no MTP weights in this checkpoint
            targets = {n: t for n, t in targets.items() if not n.startswith(first_mtp)}
        missing = sorted(set(targets) - filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}; the "
                             f"model would run with uninitialised weights.")
        if staging is not None:
            staging.finish()
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.finish_loading()
        # on CUDA the merged q + kv_a GEMM applies the input norm; not with FP8 or biased
        # projections (no merged weight: `fold_norms`); CPU float32 keeps the norms as they are
        if (self.embed_tokens.weight.is_cuda and self.dtype in (torch.bfloat16, torch.float16)
                and all(layer.self_attn.q_kv_a_weight is not None for layer in self.layers)):
            self.fold_norms()

    def fold_norms(self) -> None:
        """Fold each decoder layer's input RMSNorm weight into its merged q + kv_a projection
        (`kernels.fused_linear.fold_norm_weight`; the norm keeps an all-ones weight) and switch
        the layers to `DeepseekDecoderLayer.forward_folded`. Same function, rounded
        differently. Called once, after loading. The MTP modules' blocks stay unfolded.

        The fold needs plain weights: a column scale on an FP8 block-scaled weight is not a
        multiply of its codes (each 128 x 128 block shares one scale, so W * g would have to
        be re-quantized, changing every code), so layers whose projections stay FP8 (or carry
        a bias) cannot merge and the model is left unfolded.

        Raises:
            ValueError: a layer's q + kv_a projections cannot be merged (FP8 or biased).
        """
        if not all(layer.self_attn.merge_q_kv_a() for layer in self.layers):
            raise ValueError("fold_norms needs every layer's q and kv_a projections merged; "
                             "FP8 or biased projections cannot be (the model stays unfolded).")
        for layer in self.layers:
            layer.self_attn.fold_input_norm(layer.input_layernorm.weight)
            layer.norms_folded = True


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite: softmax scores, greedy or group_limited_greedy routing."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 / R1: sigmoid scores with noaux_tc routing unless the config says otherwise
    (transformers' V3 router always routes this way)."""

    default_scoring_func = "sigmoid"
    default_topk_method = "noaux_tc"
