"""Our DeepSeek-V2/V3 model (MLA latent cache, MoE, YaRN) vs transformers' own DeepseekV2/V3 on
the same random weights, greedy.

Variants (tests/engine/deepseek_configs.py): V3 with q_lora + noaux_tc routing + YaRN; V2-Lite
style (no q_lora, greedy softmax routing); V2 with group_limited_greedy routing + YaRN; V3 with
tied embeddings, attention biases and half-split rotary dims. All have a dense first layer and
shared experts. The paged driver of test_llama_parity allocates the KV
cache from the model's spec. Tolerance (float32 logits of magnitude ~3): atol 1e-4, rtol 1e-4
(observed ~3e-6). Greedy tokens must be identical for 32 new tokens on every prompt, alone and in
mixed varlen steps (staggered arrivals, 5-token prefill chunks next to decodes), and through
`LLM.generate` batched with other requests.
"""

import importlib.util
import os

import pytest
import torch
from deepseek_configs import VARIANTS, randomize_router_bias, tiny_deepseek_config
from test_llama_parity import (MAX_NEW_TOKENS, PagedDriver, generate_greedy, hf_greedy,
                               load_hf_reference)

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.kv_cache.spec import MLAAttentionSpec
from deepinfer.engine.llm import LLM
from deepinfer.engine.loader import load_model
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PROMPT_LENS = [1, 6, 13, 29]


def save_tiny_deepseek(path, variant: str, **overrides):
    """Build the HF model for `variant` with random weights, save it to `path`, return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_deepseek_config(variant, **overrides))
    randomize_router_bias(hf_model.eval())
    hf_model.save_pretrained(path)
    return hf_model


@pytest.fixture(scope="module", params=VARIANTS)
def deepseek_pair(request, tmp_path_factory):
    """(our model, HF reference, checkpoint dir) with the same random weights, through disk."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp(request.param)
    save_tiny_deepseek(path, request.param)
    return (load_model(path, torch.float32, "cpu"), load_hf_reference(AutoModelForCausalLM, path),
            path)


def _prompts(vocab_size=256):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _assert_matches_hf(hf_model, prompts, tokens, logits):
    hf_tokens, hf_logits = hf_greedy(hf_model, prompts)
    for seq in range(len(prompts)):
        assert tokens[seq] == hf_tokens[seq], f"prompt {seq}"
        torch.testing.assert_close(logits[seq], hf_logits[seq], atol=1e-4, rtol=1e-4)


def test_one_sequence_at_a_time_matches_hf(deepseek_pair):
    ours, hf_model, _ = deepseek_pair
    prompts = _prompts()
    results = [generate_greedy(PagedDriver(ours, num_blocks=32, block_size=4), [prompt])
               for prompt in prompts]
    _assert_matches_hf(hf_model, prompts, [t[0] for t, _ in results],
                       [lg[0] for _, lg in results])


def test_mixed_varlen_steps_match_hf(deepseek_pair):
    ours, hf_model, _ = deepseek_pair
    prompts = _prompts()
    tokens, logits = generate_greedy(PagedDriver(ours, num_blocks=96, block_size=4, seed=3),
                                     prompts, chunk_size=5, stagger=True)
    _assert_matches_hf(hf_model, prompts, tokens, logits)


def test_kv_cache_is_one_latent_vector_per_token(deepseek_pair):
    ours, _, _ = deepseek_pair
    spec = ours.kv_cache_spec(4)
    assert spec == MLAAttentionSpec(num_layers=3, kv_lora_rank=32, qk_rope_head_dim=16,
                                    dtype_bytes=4)
    assert spec.kv_cache_shape(10, 16) == (10, 16, 48)
    assert spec.bytes_per_token() == 3 * 48 * 4  # vs 3 * 2 * 4 heads * 32 * 4 for MHA K/V
    assert ours.num_mtp_layers == 0  # HF checkpoints carry no MTP weights


def test_layer_kinds_follow_config(deepseek_pair):
    from deepinfer.engine.models.deepseek import DeepseekMoEBlock
    from deepinfer.engine.models.layers.mlp import GatedMLP

    ours, _, _ = deepseek_pair
    assert isinstance(ours.layers[0].mlp, GatedMLP)  # first_k_dense_replace=1
    assert all(isinstance(layer.mlp, DeepseekMoEBlock) for layer in ours.layers[1:])
    assert torch.equal(ours.layers[1].mlp.moe.logical_to_physical, torch.arange(8))


# ---------------------------------------------------------------- through the whole engine


@pytest.fixture(scope="module")
def tiny_deepseek_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny V3 checkpoint with the SmolLM2 tokenizer (vocab 49152), as `deepinfer serve`
    would load it."""
    path = tmp_path_factory.mktemp("tiny-deepseek")
    tokenizer = smollm2_tokenizer
    save_tiny_deepseek(path, "v3_qlora_noaux_tc_yarn", vocab_size=len(tokenizer),
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(path)
    return path


ENGINE_PROMPTS = _prompts(vocab_size=49152) + [list(range(500, 540)), [7] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _make_llm(model_dir, num_blocks: int) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24)))


@pytest.fixture(scope="module")
def hf_engine_tokens(tiny_deepseek_dir):
    from transformers import AutoModelForCausalLM

    return hf_greedy(load_hf_reference(AutoModelForCausalLM, tiny_deepseek_dir),
                     ENGINE_PROMPTS)[0]


def test_llm_generate_batched_matches_hf(tiny_deepseek_dir, hf_engine_tokens):
    """6 requests batched (24-token budget: chunked prefill next to decodes), then one again
    alone (a prefix-cache hit on its earlier blocks)."""
    llm = _make_llm(tiny_deepseek_dir, num_blocks=256)
    assert [out.token_ids for out in llm.generate(ENGINE_PROMPTS, GREEDY)] == hf_engine_tokens
    assert llm.generate([ENGINE_PROMPTS[3]], GREEDY)[0].token_ids == hf_engine_tokens[3]
    pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == 256  # every block back (cached-free counts as free)


def test_llm_generate_after_preemption_matches_hf(tiny_deepseek_dir, hf_engine_tokens):
    llm = _make_llm(tiny_deepseek_dir, num_blocks=40)  # the 6 requests need ~76 blocks
    assert [out.token_ids for out in llm.generate(ENGINE_PROMPTS, GREEDY)] == hf_engine_tokens
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert llm.engine_core.scheduler.kv_cache_manager.block_pool.num_free_blocks == 40


def test_moe_layer_freq_alternates_dense_and_moe_layers():
    from deepinfer.engine.models.deepseek import DeepseekMoEBlock, DeepseekV2ForCausalLM

    config = tiny_deepseek_config("v2_lite_greedy", num_hidden_layers=5, moe_layer_freq=2)
    model = DeepseekV2ForCausalLM(config, torch.float32)
    kinds = [isinstance(layer.mlp, DeepseekMoEBlock) for layer in model.layers]
    assert kinds == [False, False, True, False, True]  # dense first layer, then every 2nd


def test_bfloat16_model_tracks_hf_bfloat16(deepseek_pair):
    """bf16 weights and latent cache vs transformers in bf16 on the same weights: first-step
    logits within bf16 error (atol 0.06; observed <= 0.016, while either side moves by up to
    0.45 from its float32 logits on these random weights)."""
    from transformers import AutoModelForCausalLM

    _, _, path = deepseek_pair
    prompt = _prompts()[2]
    ours = load_model(path, torch.bfloat16, "cpu")
    assert ours.layers[1].mlp.moe.gate_weight.dtype == torch.float32  # router stays fp32
    logits = PagedDriver(ours, num_blocks=8, block_size=4).step({0: prompt})[0]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.06, rtol=0.02)


# ---------------------------------------------------------------- folded input norms

FOLDABLE = [v for v in VARIANTS if v != "v3_tied_bias_no_interleave"]   # no attention biases


@pytest.mark.parametrize("variant", FOLDABLE)
def test_folded_input_norms_match_hf(variant, tmp_path):
    """`fold_norms` (what CUDA bf16 loads do): each input RMSNorm weight moved into the merged
    q + kv_a weight, the layers on `forward_folded` (the residual stream as (pending,
    residual)); on CPU every op takes its unfused form, so this checks the merge, the fold and
    the stream, in float32, against HF (atol 1e-4, as the unfolded model)."""
    from transformers import AutoModelForCausalLM

    save_tiny_deepseek(tmp_path, variant)
    folded = load_model(tmp_path, torch.float32, "cpu")
    assert all(layer.self_attn.q_kv_a_weight is None for layer in folded.layers)   # CPU
    folded.fold_norms()
    for layer in folded.layers:
        assert layer.norms_folded and layer.self_attn.q_kv_a_weight is not None
        assert torch.equal(layer.input_layernorm.weight,
                           torch.ones_like(layer.input_layernorm.weight))
    prompts = _prompts()
    tokens, logits = generate_greedy(PagedDriver(folded, num_blocks=96, block_size=4, seed=3),
                                     prompts, chunk_size=5, stagger=True)
    _assert_matches_hf(load_hf_reference(AutoModelForCausalLM, tmp_path), prompts, tokens,
                       logits)


def test_fold_is_refused_for_biased_projections(tmp_path):
    """A biased q_a / kv_a projection cannot merge, so nothing is folded (an FP8 one neither:
    `DeepseekForCausalLM.fold_norms`)."""
    save_tiny_deepseek(tmp_path, "v3_tied_bias_no_interleave")
    model = load_model(tmp_path, torch.float32, "cpu")
    norm_weights = [layer.input_layernorm.weight.clone() for layer in model.layers]
    with pytest.raises(ValueError, match="merged"):
        model.fold_norms()
    assert not any(layer.norms_folded for layer in model.layers)
    assert all(torch.equal(layer.input_layernorm.weight, before)
               for layer, before in zip(model.layers, norm_weights))


@pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1"
                         and importlib.util.find_spec("triton")),
                    reason="runs the fused kernels through TRITON_INTERPRET=1 on CPU")
def test_fused_kernels_carry_the_stream_through_the_layers(monkeypatch, tmp_path):
    """Every fused kernel the folded layers can run (`kernels.fused_linear.fused_config`
    forced to a small tile config; float32 through Triton's interpreter): the input norm in
    the q + kv_a GEMM, the residual adds in o_proj, the dense down projection (its AddedRows
    read by the next layer's norm) and the shared experts' down projection (the routed
    combine adding onto the stream). Every layer's input norm must find nothing pending, and
    the logits of a prefill and 3 decode steps equal the unfolded model's (atol 1e-4)."""
    from deepinfer.engine.models.layers.linear import Linear
    from deepinfer.kernels import fused_linear

    save_tiny_deepseek(tmp_path, "v2_lite_greedy")
    reference, model = (load_model(tmp_path, torch.float32, "cpu") for _ in range(2))
    model.fold_norms()
    for module in model.modules():   # CPU packed copies would take the unfused path
        if isinstance(module, Linear):
            module.packed_weight = module.quantized_weight = None
    asked = []

    def every_shape_fused(fusion, x, weight, settings=None):
        asked.append(fusion)
        return {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2,
                "SPLIT_K": 2 if fusion == "residual" else 1}

    monkeypatch.setattr(fused_linear, "fused_config", every_shape_fused)
    drivers = [PagedDriver(m, num_blocks=8, block_size=4) for m in (reference, model)]
    chunk, num_layers = _prompts()[1], len(model.layers)
    for _ in range(4):
        expected, got = (driver.step({0: chunk})[0] for driver in drivers)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        # one norm GEMM per layer (nothing pending), residual GEMMs in o_proj and the MLPs
        assert asked.count("norm") == num_layers and asked.count("residual") == 2 * num_layers
        asked.clear()
        chunk = [int(expected.argmax())]
