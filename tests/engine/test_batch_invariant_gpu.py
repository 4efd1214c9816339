"""Batch-invariant mode on CUDA, whole engine, random bf16 Llama and tiny DeepSeek-V2 / V3 (MLA,
MoE) with CUDA graphs: a request's token ids and logprob floats are the same bits alone (no
prefix caching, one prefill chunk), inside a batch of 64 mixed requests (decode graphs padded to
their captured sizes), under chunked prefill, after a prefix-cache hit, after preemption, and
with speculative decoding on (varlen and fixed length). Greedy and seeded requests. (The CPU
twin: test_batch_invariant.py.)
"""

import gc

import pytest
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from deepseek_configs import randomize_router_bias, tiny_deepseek_config, write_fp8_dirs
from test_batch_invariant import mixed_batch as shared_mixed_batch
from test_batch_invariant import signature, targets_of
from test_gpu_engine import write_random_llama_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 512
TARGETS = [
    (list(range(100, 137)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                           logprobs=5)),
    ([9, 8, 7] * 5, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20,
                                   ignore_eos=True, logprobs=5)),
    (list(range(3, 300, 3)), SamplingParams(temperature=1.2, top_k=20, seed=5, max_tokens=20,
                                            ignore_eos=True, logprobs=5)),
    ([42], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)),
]


@pytest.fixture(scope="module", params=["llama", "v2_lite_greedy", "v3_qlora_noaux_tc_yarn",
                                        "v3_fp8_experts"])
def model_dir(request, tmp_path_factory):
    """A random Llama, or a tiny DeepSeek-V2 / V3 (MLA, MoE; V3: q_lora, noaux_tc, YaRN);
    v3_fp8_experts: that V3 at hidden / expert sizes of 128 as an FP8 checkpoint, whose
    routed experts stay FP8 (the grouped FP8 GEMMs at the invariant tile)."""
    path = tmp_path_factory.mktemp(f"gpu-invariant-{request.param}")
    if request.param == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=1024, initializer_range=0.1,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        return write_random_llama_dir(path, config)
    from transformers import AutoModelForCausalLM

    if request.param != "v3_fp8_experts":
        model = AutoModelForCausalLM.from_config(tiny_deepseek_config(request.param,
                                                                      vocab_size=VOCAB))
        randomize_router_bias(model.eval())
        return write_random_llama_dir(path, model.config, model=model)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(
        "v3_qlora_noaux_tc_yarn", vocab_size=VOCAB, hidden_size=128, moe_intermediate_size=128))
    randomize_router_bias(model.eval())
    write_random_llama_dir(path / "bf16", model.config, model=model)
    write_fp8_dirs(path / "bf16", path / "fp8", path / "dequantized")
    return path / "fp8"


def make_llm(model_dir, **fields) -> LLM:
    options = dict(model=str(model_dir), dtype="bfloat16", device="cuda", block_size=16,
                   num_blocks=512, max_num_seqs=64, max_num_batched_tokens=2048,
                   batch_invariant=True)
    options.update(fields)
    return LLM(config=EngineConfig().with_fields(**options))


def run(llm: LLM, requests) -> list[tuple]:
    prompts, params = zip(*requests)
    outputs = [signature(o) for o in llm.generate(list(prompts), list(params))]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outputs


def mixed_batch(size: int) -> list:
    return shared_mixed_batch(size, TARGETS, token_ids=(3, VOCAB), max_prompt=200)


@pytest.fixture(scope="module")
def alone(model_dir):
    llm = make_llm(model_dir, enable_prefix_caching=False)
    if model_dir.name == "fp8":   # the experts this variant exists for stayed FP8
        moes = [m for m in llm.engine_core.executor.runner.model.modules()
                if type(m).__name__ == "MoE"]
        assert moes and all(m.w13.dtype == torch.float8_e4m3fn for m in moes)
    outputs = [llm.generate([p], [s])[0] for p, s in TARGETS]
    del llm
    gc.collect()
    return [signature(o) for o in outputs]


def targets(requests, results):
    return targets_of(requests, results, TARGETS)


def test_alone_equals_inside_a_batch_of_64(model_dir, alone):
    requests = mixed_batch(64)
    assert targets(requests, run(make_llm(model_dir), requests)) == alone
    assert all(len(ids) == 20 for ids, _ in alone)


def test_chunked_prefill_and_preemption_equal_alone(model_dir, alone):
    requests = mixed_batch(24)
    assert targets(requests, run(make_llm(model_dir, max_num_batched_tokens=32,
                                          enable_prefix_caching=False), requests)) == alone
    llm = make_llm(model_dir, num_blocks=40, enable_prefix_caching=False)
    results = [signature(o) for o in llm.generate([p for p, _ in requests],
                                                  [s for _, s in requests])]
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert targets(requests, results) == alone


def test_prefix_cache_hit_equals_alone(model_dir, alone):
    llm = make_llm(model_dir)
    llm.generate([p[:-3] + [5, 5, 5] for p, _ in TARGETS], SamplingParams(max_tokens=1))
    outputs = llm.generate([p for p, _ in TARGETS], [s for _, s in TARGETS])
    assert outputs[0].num_cached_tokens >= 32
    assert [signature(o) for o in outputs] == alone


@pytest.mark.parametrize("spec_varlen", [True, False], ids=["varlen", "fixed"])
def test_speculative_decoding_equals_plain(model_dir, alone, spec_varlen):
    requests = mixed_batch(8)
    llm = make_llm(model_dir, speculative_method="ngram", num_speculative_tokens=4,
                   spec_varlen=spec_varlen, enable_prefix_caching=False)
    assert targets(requests, run(llm, requests)) == alone
