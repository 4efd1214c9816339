"""DeepSeek on CUDA in bf16 with its input RMSNorm weights folded into the merged q + kv_a GEMM
and the residual adds in o_proj and the down projections (`kernels/fused_linear.py`), fused
against the same folded model with fusion off.

The norm weights are randomised (HF initialises them to ones, which would make the fold a
no-op). A config file naming the tiny model's shapes makes every one of those linears run fused
at decode; the shared experts run on the second stream (decode-sized rows), their fused down
projection adding into the stream that the routed combine then adds onto. Every routed expert
is picked by every token (top-k = all experts), so bf16 rounding cannot flip an expert choice,
a discontinuity that would make logits of the two paths differ by more than rounding. The
relative error of NEW_TOKENS decode steps' logits, fed the same tokens on both sides, must
stay < 5e-2 (as the Llama test's: bf16 rounding through 3 random layers).
"""

import pytest
import torch
from test_fused_llama_gpu import (NEW_TOKENS, decode_logits, save_with_random_norms,
                                  write_fused_config)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, HEADS, NOPE, ROPE, V, KV_LORA = 256, 8, 64, 32, 64, 128
INTER, MOE_INTER = 512, 128


@pytest.fixture
def tiny_bf16_dir(tmp_path):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=INTER,
        moe_intermediate_size=MOE_INTER, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=KV_LORA, q_lora_rank=None,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V, topk_method="greedy",
        routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=1024,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return save_with_random_norms(DeepseekV2ForCausalLM, config, tmp_path)


@pytest.fixture
def fused_everywhere(monkeypatch, tmp_path_factory):
    """A fused_linear config file with the tiny model's shapes all fused at 16 rows."""
    from deepinfer.kernels import backends, fused_linear

    shapes = [("norm", HEADS * (NOPE + ROPE) + KV_LORA + ROPE, HIDDEN),   # q + kv_a
              ("residual", HIDDEN, HEADS * V),                              # o
              ("residual", HIDDEN, INTER),                                  # dense down
              ("residual", HIDDEN, MOE_INTER)]                              # shared down
    entries = [{"fusion": fusion, "block_m": 16, "out_features": n, "in_features": k,
                "config": {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2,
                           "SPLIT_K": 2 if fusion == "residual" else 1},
                "fused_faster": True} for fusion, n, k in shapes]
    write_fused_config(monkeypatch, tmp_path_factory.mktemp("configs"), entries)
    yield fused_linear
    backends.tuned_table.cache_clear()


def test_fused_folded_decode_matches_unfused(tiny_bf16_dir, fused_everywhere, monkeypatch):
    from deepinfer.engine.loader import load_model
    from deepinfer.engine.models.layers import set_kernel_config
    from deepinfer.kernels.settings import KernelConfig

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 30, 12)]
    continuations = [torch.randint(3, 512, (NEW_TOKENS,), generator=gen).tolist()
                     for _ in prompts]
    ours = load_model(tiny_bf16_dir, torch.bfloat16, "cuda")
    assert all(layer.norms_folded for layer in ours.layers)
    norm_gemms = []
    fused_norm_linear = fused_everywhere.fused_norm_linear
    monkeypatch.setattr(fused_everywhere, "fused_norm_linear",
                        lambda *args, **kwargs: norm_gemms.append(1)
                        or fused_norm_linear(*args, **kwargs))
    fused = decode_logits(ours, prompts, continuations)
    # every decode step's every layer found the stream with nothing pending
    assert len(norm_gemms) == NEW_TOKENS * len(ours.layers)
    set_kernel_config(ours, KernelConfig(fused_linears=False))
    unfused = decode_logits(ours, prompts, continuations)
    error = float((fused.double() - unfused.double()).norm() / unfused.double().norm())
    assert error < 5e-2
