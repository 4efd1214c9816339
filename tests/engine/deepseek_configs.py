"""Tiny random DeepSeek configs for tests and benchmarks (hidden 64, 3 layers, 8 experts).

Variants cover what the issue lists: V3 with q_lora, noaux_tc routing (random
e_score_correction_bias), YaRN with both mscale terms; V2-Lite style without q_lora, greedy
softmax routing; V2 with q_lora, group_limited_greedy routing and YaRN; V3 with tied embeddings,
attention biases, half-split (not interleaved) rotary dims and a single expert group. Each has a
dense first layer and shared experts.
"""

from __future__ import annotations

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
        "beta_fast": 32, "beta_slow": 1}
VARIANTS = ("v3_qlora_noaux_tc_yarn", "v2_lite_greedy", "v2_group_limited_yarn",
            "v3_tied_bias_no_interleave")


def tiny_deepseek_config(variant: str, vocab_size: int = 256, **overrides):
    """An HF DeepseekV3Config / DeepseekV2Config for `variant` (one of VARIANTS)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                  first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16,
                  qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=None,
                  tie_word_embeddings=False)
    if variant == "v3_qlora_noaux_tc_yarn":
        config = DeepseekV3Config(**common, q_lora_rank=48, n_shared_experts=1, n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  rope_parameters=dict(YARN), num_nextn_predict_layers=1)
    elif variant == "v3_tied_bias_no_interleave":
        common.update(tie_word_embeddings=True)
        config = DeepseekV3Config(**common, q_lora_rank=48, n_shared_experts=2, n_group=1,
                                  topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                                  attention_bias=True, rope_interleave=False,
                                  num_nextn_predict_layers=0)
    elif variant == "v2_lite_greedy":
        config = DeepseekV2Config(**common, q_lora_rank=None, n_shared_experts=2,
                                  topk_method="greedy", routed_scaling_factor=1.0,
                                  norm_topk_prob=False)
    else:
        assert variant == "v2_group_limited_yarn", variant
        config = DeepseekV2Config(**common, q_lora_rank=48, n_shared_experts=1,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.5, norm_topk_prob=False,
                                  rope_parameters=dict(YARN, mscale=0.9, mscale_all_dim=0.9))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def randomize_router_bias(hf_model, seed: int = 0) -> None:
    """HF initialises e_score_correction_bias and linear biases to zeros; make them matter."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=gen) * 0.5)
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def write_fp8_dirs(source, fp8_dir, dequantized_dir, block=(128, 128), dtype=None,
                   quantized=None) -> None:
    """From the HF checkpoint directory `source` (one model.safetensors), write a DeepSeek-V3
    style FP8 checkpoint to `fp8_dir` (the `quantized(name, tensor)` weights, default: every
    projection inside the layers, kv_a_proj_with_mqa included, as float8_e4m3fn +
    weight_scale_inv per `block` tile) and
    the same weights dequantized (to `dtype`, default each tensor's own) to
    `dequantized_dir`; config and any tokenizer files are copied to both."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from deepinfer.kernels.fp8 import dequantize_block_fp8, quantize_block_fp8

    source = Path(source)
    quantized = quantized or (lambda name, tensor: name.startswith("model.layers.")
                              and "_proj" in name and name.endswith(".weight")
                              and tensor.dim() == 2)
    fp8, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        fp8[name] = dequantized[name] = tensor
        if quantized(name, tensor):
            codes, scale_inv = quantize_block_fp8(tensor.float(), block)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = codes, scale_inv
            dequantized[name] = dequantize_block_fp8(codes, scale_inv, block,
                                                     dtype or tensor.dtype)
    config = json.loads((source / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block)}
    for path, weights, extra in ((fp8_dir, fp8, {"quantization_config": quant}),
                                 (dequantized_dir, dequantized, {})):
        path = Path(path)
        path.mkdir(parents=True)
        for file in source.iterdir():
            if file.name not in ("model.safetensors", "config.json") and file.is_file():
                shutil.copy(file, path / file.name)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, **extra}))
