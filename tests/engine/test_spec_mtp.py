"""The MTP drafter (engine/spec/mtp.py) on a tiny random DeepSeek-V3 with one MTP module:
greedy and seeded outputs equal plain decoding's, in a batch, fixed and varlen; every block comes
back; and the online per-position temperature scaling fits a known temperature."""

import math
import random

import pytest
import torch
from test_deepseek_mtp import _mtp_weights, _prefill_metadata
from test_deepseek_parity import save_tiny_deepseek

from deepinfer.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                     SpeculativeConfig)
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.spec.mtp import PositionTemperatures

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PROMPTS = [list(range(500, 520)), [7, 8, 9] * 4, list(range(3000, 3033))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)]


@pytest.fixture(scope="module")
def tiny_v3_mtp_dir(tmp_path_factory, smollm2_tokenizer):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny-v3-mtp")
    tokenizer = smollm2_tokenizer
    hf_model = save_tiny_deepseek(path, "v3_qlora_noaux_tc_yarn", vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    tensors, _ = _mtp_weights(hf_model.config, hf_model.lm_head.weight.data,
                              hf_model.model.embed_tokens.weight.data)
    save_file(tensors, path / "model-mtp.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return path


def make_llm(path, spec=None, num_blocks=96):
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        speculative=spec or SpeculativeConfig()))


def test_mtp_drafts_leave_outputs_unchanged(tiny_v3_mtp_dir):
    expected = make_llm(tiny_v3_mtp_dir).generate(PROMPTS, PARAMS)
    for varlen in (False, True):
        llm = make_llm(tiny_v3_mtp_dir, SpeculativeConfig(
            speculative_method="mtp", num_speculative_tokens=3, spec_varlen=varlen))
        assert llm.engine_core.executor.runner.drafter is not None
        outputs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        assert [lp.logprob for lp in outputs[2].logprobs] == pytest.approx(
            [lp.logprob for lp in expected[2].logprobs], abs=1e-4)
        if not varlen:   # fixed length verifies every draft the module made
            assert llm.engine_core.spec.stats.num_draft_tokens > 0
        pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
        assert pool.num_free_blocks == 96


def test_mtp_drafts_are_the_module_chained_over_the_whole_sequence(tiny_v3_mtp_dir):
    """After the prefill step the drafter holds gamma drafts after the first sampled token:
    the same as the module run over the whole sequence without a cache, row p fed (h_p,
    t_{p+1}) for the known tokens and (its own hidden at p - 1, draft) for the drafts."""
    gamma = 3
    llm = make_llm(tiny_v3_mtp_dir, SpeculativeConfig(speculative_method="mtp",
                                                      num_speculative_tokens=gamma))
    core = llm.engine_core
    prompt = list(range(500, 520))
    core.add_request(core.make_request(prompt, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True), "r"))
    core.step()
    runner = core.executor.runner
    tokens = prompt + core.scheduler.requests["r"].output_token_ids
    length, drafts, probs = runner.drafter._drafts["r"]
    assert length == len(tokens) == len(prompt) + 1 and len(drafts) == gamma
    n = len(prompt)
    model = runner.model
    caches = [torch.zeros((16, *c.shape[1:]), dtype=c.dtype) for c in runner.kv_caches]
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens[:n]), torch.arange(n), caches,
                       _prefill_metadata(n, 4))
        rows_hidden, next_ids, expected = hidden, tokens[1:n + 1], []
        for j in range(gamma):
            rows = n + j
            logits, mtp_hidden = model.mtp_forward(rows_hidden, torch.tensor(next_ids),
                                                   torch.arange(rows), caches,
                                                   _prefill_metadata(rows, 4))
            expected.append(int(logits[-1].argmax()))
            assert probs[j] == pytest.approx(float(logits[-1].softmax(-1).max()), abs=1e-4)
            rows_hidden = torch.cat([hidden, mtp_hidden[n - 1:]])
            next_ids = next_ids + [expected[-1]]
    assert drafts == expected


def test_per_position_temperature_scaling_recovers_a_known_temperature():
    rng = random.Random(0)
    scaler = PositionTemperatures(1)
    true_t = 2.0
    for _ in range(4096):
        q = rng.uniform(0.02, 0.98)
        logit = math.log(q / (1 - q))
        accepted = rng.random() < 1 / (1 + math.exp(-logit / true_t))
        scaler.add(0, q, accepted)
    assert abs(scaler.temperatures[0] - true_t) < 0.5
    assert scaler.confidence(0, 0.9) == pytest.approx(
        1 / (1 + math.exp(-math.log(9) / scaler.temperatures[0])))


def test_a_model_without_mtp_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP module"):
        make_llm(tiny_llama_dir, SpeculativeConfig(speculative_method="mtp"))
