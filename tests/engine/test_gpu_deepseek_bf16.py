"""A small random DeepSeek in bfloat16 on CUDA (Triton MLA kernels, FP8 linears kept in FP8)
against HF transformers in bfloat16: greedy tokens over NEW_TOKENS steps.

As in test_gpu_bf16_parity.py (read its docstring for the argument): two correct bf16
implementations round differently, so near-ties can go either way and a continuation then
differs. What must hold:
1. every step, every prompt, with the engine's own tokens fed to HF (teacher forcing), HF's
   logit of the engine's token is within TIE_MARGIN x the row's logit RMS of HF's largest;
2. at least MIN_EXACT_PROMPTS of the 8 prompts are token-exact over all NEW_TOKENS steps.
The FP8 variant: the engine's linears run the FP8 GEMM, which also rounds each activation to
e4m3 (3 mantissa bits, ~3% RMS per value), against HF on the dequantized weights in bf16, so its
margin is wider (FP8_TIE_MARGIN) and no prompt needs to be exact. Its layers are all dense: with
routed experts, activation noise of that size flips near-tie expert choices, a discontinuity
that turns small logit differences into large ones (an MoE version of this test, run once on
the H200 on 2026-12-04, had departures beyond 0.5 of the RMS; the list was cut off by the call's
time limit). `test_fp8_linears_match_their_dequantized_weights` checks each FP8 linear directly.
"""

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 37, 64, 18, 90, 11, 128, 3)
MIN_EXACT_PROMPTS = 1
TIE_MARGIN = 0.2
FP8_TIE_MARGIN = 0.5
MAX_FP8_EXPERT_DEPARTURES = 16   # of 8 x 32 steps (test_fp8_checkpoint_experts_stay_fp8)


def _config(variant: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                  moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=2,
                  first_k_dense_replace=1, kv_lora_rank=128, qk_rope_head_dim=32,
                  qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=1024,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, n_shared_experts=1)
    if variant == "v2_bf16":
        return DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy",
                                routed_scaling_factor=1.0, norm_topk_prob=False)
    if variant != "v3_fp8_moe":
        common["first_k_dense_replace"] = common["num_hidden_layers"]   # dense only (docstring)
    return DeepseekV3Config(**common, q_lora_rank=128, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, norm_topk_prob=True,
                            num_nextn_predict_layers=0)


def _save(variant, path):
    """(engine dir, HF reference dir): the FP8 variant stores its in-layer projections as
    float8 + 128 x 128 scales, and HF gets the dequantized bf16 weights."""
    from deepseek_configs import write_fp8_dirs
    from test_gpu_engine import write_random_llama_dir
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(variant)).to(torch.bfloat16).eval()
    write_random_llama_dir(path / "hf", model.config, model=model)
    if variant == "v2_bf16":
        return path / "hf", path / "hf"
    write_fp8_dirs(path / "hf", path / "fp8", path / "deq")
    return path / "fp8", path / "deq"


def _engine_greedy(model_dir, prompts, fp8_gemm=True):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.models.layers.linear import Linear
    from deepinfer.engine.sampling_params import SamplingParams

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "bfloat16"},
        cache={"gpu_memory_utilization": 0.05},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
        kv_transfer={"kv_store": "none"}, kernel={"fp8_block_gemm": fp8_gemm})
    llm = LLM(config=config)
    model = llm.engine_core.executor.runner.model
    num_fp8 = sum(isinstance(m, Linear) and m.weight_scale_inv is not None
                  for m in model.modules())
    fp8_experts = [type(m).__name__ == "MoE" and m.w13.dtype == torch.float8_e4m3fn
                   for m in model.modules() if type(m).__name__ == "MoE"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = [out.token_ids for out in llm.generate(prompts, params)]
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, num_fp8, fp8_experts


def _hf_departures(hf_dir, prompts, got, margin):
    """(prompts token-exact against HF `generate`, [(prompt, step, gap)] where HF's logit of
    the engine's token, teacher-forced, is more than `margin` x the row's logit RMS below HF's
    largest)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    hf.generation_config.eos_token_id = None
    exact, departures = 0, []
    with torch.inference_mode():
        for seq, (prompt, tokens) in enumerate(zip(prompts, got)):
            assert len(tokens) == NEW_TOKENS
            ids = torch.tensor([prompt], device="cuda")
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, pad_token_id=0)[0, len(prompt):]
            exact += expected.tolist() == tokens
            forced = torch.tensor([prompt + tokens], device="cuda")
            logits = hf(forced).logits[0, len(prompt) - 1:-1].float()
            chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
            gap = (logits.max(dim=-1).values - chosen) / logits.pow(2).mean(-1).sqrt()
            departures += [(seq, step, round(float(g), 4)) for step, g in enumerate(gap)
                           if g > margin]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return exact, departures


def _prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("variant", [
    "v2_bf16",
    pytest.param("v3_fp8", marks=pytest.mark.xfail(
        reason="the Triton FP8 GEMM (fp8_block_gemm=True, off by default) left HF by up to "
               "0.94 of the logit RMS on the H200 (2026-12-04): open, see kernels/settings.py",
        strict=False)),
    "v3_fp8_torch_gemm"])
def test_deepseek_bf16_greedy_tokens_match_hf_but_at_near_ties(variant, tmp_path):
    """v3_fp8_torch_gemm: the FP8 checkpoint with `fp8_block_gemm=False` (the default): its
    weights are dequantized at load and run in bf16, so the bf16 margin applies (measured on
    the H200, 2026-12-04: 2 of 8 prompts exact, no departure beyond 0.2)."""
    fp8_gemm = variant != "v3_fp8_torch_gemm"
    variant = "v3_fp8" if variant.startswith("v3_fp8") else variant
    engine_dir, hf_dir = _save(variant, tmp_path)
    prompts = _prompts()
    got, num_fp8, _ = _engine_greedy(engine_dir, prompts, fp8_gemm)
    assert (num_fp8 > 0) == (variant == "v3_fp8" and fp8_gemm)
    margin = FP8_TIE_MARGIN if variant == "v3_fp8" and fp8_gemm else TIE_MARGIN
    exact, departures = _hf_departures(hf_dir, prompts, got, margin)
    print(f"{variant}: {exact} of {len(prompts)} prompts token-exact over {NEW_TOKENS} "
          f"tokens; departures beyond {margin}: {departures}")
    assert departures == [], f"(prompt, step, gap / logit RMS) beyond {margin}"
    assert exact >= (MIN_EXACT_PROMPTS if variant == "v2_bf16" else 0)


def test_fp8_checkpoint_experts_stay_fp8(tmp_path):
    """An FP8 checkpoint with routed experts under the default kernel config: its experts
    load as float8 codes + scales and run the grouped FP8 GEMMs (activations rounded to e4m3
    per token and 128-channel block), its linears dequantized.
    1. Each MoE layer against the same layer of the dequantized bf16 checkpoint, same inputs
       (so the same routing): relative error < 6e-2 (e4m3 activations: ~3% RMS per value).
    2. Greedy decoding against HF on the dequantized weights, teacher-forced: at most
       MAX_FP8_EXPERT_DEPARTURES of the 256 steps more than FP8_TIE_MARGIN x the logit RMS
       below HF's choice. Here the activation rounding also flips near-tie expert choices of
       later layers, which moves the logits further (module docstring): 7 steps on an H100,
       2026-12-06, the largest 1.9; the dequantized checkpoint in bf16 has none beyond 0.2."""
    from deepinfer.engine.loader import load_model
    from deepinfer.engine.moe.expert_parallel import decoder_moes

    engine_dir, hf_dir = _save("v3_fp8_moe", tmp_path)
    ours, reference = (load_model(d, torch.bfloat16, "cuda") for d in (engine_dir, hf_dir))
    gen = torch.Generator(device="cuda").manual_seed(0)
    errors = []
    with torch.inference_mode():
        for moe, ref in zip(decoder_moes(ours), decoder_moes(reference), strict=True):
            assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn
            assert ref.w13.dtype == torch.bfloat16
            hidden = torch.randn(37, moe.w13.shape[2], device="cuda", generator=gen,
                                 dtype=torch.bfloat16)
            expected = ref(hidden).float()
            errors.append(float((moe(hidden).float() - expected).norm() / expected.norm()))
    assert len(errors) == 2 and max(errors) < 6e-2, errors
    del ours, reference
    gc.collect()
    prompts = _prompts()
    got, num_fp8, fp8_experts = _engine_greedy(engine_dir, prompts, fp8_gemm=False)
    assert num_fp8 == 0 and fp8_experts == [True, True]
    exact, departures = _hf_departures(hf_dir, prompts, got, FP8_TIE_MARGIN)
    print(f"v3_fp8_moe: {exact} of {len(prompts)} prompts token-exact over {NEW_TOKENS} "
          f"tokens; departures beyond {FP8_TIE_MARGIN}: {departures}")
    assert len(departures) <= MAX_FP8_EXPERT_DEPARTURES, departures


def test_fp8_linears_match_their_dequantized_weights(tmp_path):
    """Each Linear the loader kept in FP8 (codes, scales, rope row permutation) computes, with
    the Triton FP8 GEMM, what the same Linear of the dequantized bf16 checkpoint computes, up to
    the activation's FP8 rounding: relative error < 6e-2 (e4m3: <= 2^-4 per value, ~3% RMS)."""
    from deepinfer.engine.loader import load_model
    from deepinfer.engine.models.layers.linear import Linear

    from deepinfer.kernels.settings import KernelConfig

    fp8_dir, deq_dir = _save("v3_fp8", tmp_path)
    # FP8 linears are kept only with the opt-in FP8 GEMM (fp8_block_gemm, off by default)
    ours = load_model(fp8_dir, torch.bfloat16, "cuda", KernelConfig(fp8_block_gemm=True))
    reference = load_model(deq_dir, torch.bfloat16, "cuda")
    kept = [(name, m) for name, m in ours.named_modules()
            if isinstance(m, Linear) and m.weight_scale_inv is not None]
    assert len(kept) == 18   # per layer q_a, q_b, kv_a, o, the MLP's gate_up and down
    gen = torch.Generator(device="cuda").manual_seed(0)
    errors = {}
    for name, linear in kept:
        x = torch.randn(37, linear.in_features, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
        expected = x.float() @ reference.get_submodule(name).weight.float().T
        out = linear(x)
        errors[name] = float((out.float() - expected).norm() / expected.norm())
    assert max(errors.values()) < 6e-2, errors
