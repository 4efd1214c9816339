"""Speculative decoding on the GPU (issue 30): the verify path (rows of 1 + k tokens, eager,
varlen attention) next to plain decode steps replayed from CUDA graphs; the start-up step-rate
profile; the MTP drafter on CUDA.

float32: greedy and seeded outputs must equal plain decoding's token for token. bf16: the
decode kernel and the varlen kernel round differently, so outputs must agree up to the first
position where plain decoding's top two logprobs are within TIE_MARGIN (a near tie may flip);
the test asserts that any divergence starts at such a near tie.
"""

import pytest
import torch

from deepinfer.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                     SpeculativeConfig)
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TIE_MARGIN = 0.16
CODE = ("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
        "def sub(a, b):\n    return a - b\n")
INSTRUCTIONS = ["Repeat this code exactly.", "Copy the code below without changes.",
                "Rewrite this code with docstrings.", "Tell me about this code."]


def make_llm(model_dir, dtype, spec=None):
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype, device="cuda"),
        cache=CacheConfig(block_size=16, num_blocks=1024),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        speculative=spec or SpeculativeConfig()))


def prompts_and_params(llm):
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{text}\n\n{CODE}"}], tokenize=False,
        add_generation_prompt=True) for text in INSTRUCTIONS] * 2
    params = ([SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)] * 4
              + [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=64, logprobs=2)
                 for i in range(4)])
    return prompts, params


def agree_up_to_near_ties(expected, actual):
    for want, got in zip(expected, actual):
        if got.token_ids == want.token_ids:
            continue
        first = next(i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b)
        top = want.logprobs[first].top
        assert len(top) >= 2 and top[0][1] - top[1][1] < TIE_MARGIN, (
            f"diverged at {first} without a near tie: {top}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("varlen", [True, False])
def test_ngram_on_cuda_equals_plain_decoding(smollm2_dir, dtype, varlen):
    plain = make_llm(smollm2_dir, dtype)
    prompts, params = prompts_and_params(plain)
    expected = plain.generate(prompts, params)
    assert plain.engine_core.executor.runner.cuda_graphs is not None
    del plain
    torch.cuda.empty_cache()
    spec = make_llm(smollm2_dir, dtype, SpeculativeConfig(
        speculative_method="ngram", num_speculative_tokens=5, spec_varlen=varlen))
    outputs = spec.generate(prompts, params)
    if dtype == "float32":
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    else:
        agree_up_to_near_ties(expected, outputs)
    stats = spec.engine_core.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    pool = spec.engine_core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == 1024
    if varlen:   # the profiled table: steps/s never rises with the batch
        rates = list(spec.engine_core.spec.step_rate.as_steps_per_second().values())
        assert all(a >= b * 0.999 for a, b in zip(rates, rates[1:]))


def test_mtp_on_cuda_equals_plain_decoding(tmp_path, smollm2_tokenizer):
    from safetensors.torch import save_file
    from test_deepseek_mtp import _mtp_weights
    from test_deepseek_parity import save_tiny_deepseek

    tokenizer = smollm2_tokenizer
    hf_model = save_tiny_deepseek(tmp_path, "v3_qlora_noaux_tc_yarn", vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    tensors, _ = _mtp_weights(hf_model.config, hf_model.lm_head.weight.data,
                              hf_model.model.embed_tokens.weight.data)
    save_file(tensors, tmp_path / "model-mtp.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp_path)
    prompts = [list(range(500, 540)), [7, 8, 9] * 8]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)]
    expected = make_llm(tmp_path, "float32").generate(prompts, params)
    llm = make_llm(tmp_path, "float32", SpeculativeConfig(
        speculative_method="mtp", num_speculative_tokens=3, spec_varlen=False))
    assert [o.token_ids for o in llm.generate(prompts, params)] == [
        o.token_ids for o in expected]
    assert llm.engine_core.spec.stats.num_draft_tokens > 0
