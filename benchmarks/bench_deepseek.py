"""Decode throughput of a small random DeepSeek-V3-style model: deepinfer vs HF transformers on
the same weights in the same run, plus the KV cache bytes per token of MLA vs an equivalent MHA
layout.

    python benchmarks/bench_deepseek.py [--new-tokens 32] [--batch 8] [--threads N]

1. Builds a random DeepseekV3 checkpoint (hidden 512, 4 layers with 1 dense, 8 heads, q_lora 256,
   kv_lora 128, rope 32, 16 routed experts top-4 in 4 groups + 1 shared, YaRN) with the SmolLM2
   tokenizer in a temporary directory.
2. HF transformers `generate` (greedy, exactly N new tokens, float32), batch 1 then the batch as
   one left-padded tensor; deepinfer `LLM.generate` (offline engine, float32, greedy,
   ignore_eos) on the same token ids. tokens/s = generated tokens / wall time (prefill
   included on both sides). Prints each pair, the ratio deepinfer / HF, and whether the greedy
   tokens agree.
3. KV bytes per token: MLA's latent (kv_lora_rank + qk_rope_head_dim per layer) vs MHA caching
   per-head K (qk_nope + qk_rope) and V (v_head_dim), for this config and DeepSeek-V3's (671B).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCH_CONFIG = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                    n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                    n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=256,
                    kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
                    initializer_range=0.05, tie_word_embeddings=False,
                    num_nextn_predict_layers=0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 1024, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
DEEPSEEK_V3 = dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def build_checkpoint(path: Path) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from deepinfer.engine.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None, None))
    config = DeepseekV3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, **BENCH_CONFIG)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)


def prompts_for(batch: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (16 + 4 * i,), generator=gen).tolist()
            for i in range(batch)]


def hf_run(model_dir: Path, prompts: list[list[int]], new_tokens: int
           ) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, -4:], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    return len(prompts) * new_tokens / elapsed, out[:, width:].tolist()


def deepinfer_run(llm, prompts: list[list[int]], new_tokens: int
                  ) -> tuple[float, list[list[int]]]:
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return len(prompts) * new_tokens / elapsed, [list(o.token_ids) for o in outputs]


def kv_bytes_per_token(c: dict, dtype_bytes: int) -> tuple[int, int]:
    """(MLA latent bytes, MHA per-head K+V bytes) per token across all layers."""
    mla = c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * dtype_bytes
    mha = (c["num_hidden_layers"] * c["num_attention_heads"] * dtype_bytes
           * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]))
    return mla, mha


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    args = parser.parse_args()
    import torch

    from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from deepinfer.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        build_checkpoint(model_dir)
        llm = LLM(config=EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
            cache=CacheConfig(block_size=16, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=512)))
        deepinfer_run(llm, prompts_for(1), 2)  # warm-up
        print(f"DeepSeek-V3-style random model, {args.new_tokens} new tokens, float32, "
              f"{torch.get_num_threads()} threads")
        for batch in (1, args.batch):
            prompts = prompts_for(batch)
            hf_tps, hf_tokens = hf_run(model_dir, prompts, args.new_tokens)
            ours_tps, our_tokens = deepinfer_run(llm, prompts, args.new_tokens)
            print(f"batch {batch:2d}: HF {hf_tps:8.1f} tok/s | deepinfer {ours_tps:8.1f} tok/s | "
                  f"ratio {ours_tps / hf_tps:5.2f}x | greedy tokens equal: "
                  f"{our_tokens == hf_tokens}")
    for name, config in (("bench config", BENCH_CONFIG), ("DeepSeek-V3 671B", DEEPSEEK_V3)):
        mla, mha = kv_bytes_per_token(config, 2)
        print(f"KV bytes/token ({name}, bf16): MLA {mla:,} vs MHA {mha:,} -> {mha / mla:.1f}x "
              "smaller")


if __name__ == "__main__":
    main()
