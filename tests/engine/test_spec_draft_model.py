"""The draft-model drafter (engine/spec/draft_model.py) with two tiny random Llamas sharing
the SmolLM2 tokenizer: greedy and seeded outputs equal plain decoding's; with the target
itself as the draft model every greedy draft is accepted (the draft cache and chain are
right); every block comes back."""

import pytest

from deepinfer.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                     SpeculativeConfig)
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PROMPTS = [[7] * 9, list(range(100, 123)), [3, 4, 5] * 5]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]


def make_llm(target, draft=None, varlen=False):
    spec = SpeculativeConfig()
    if draft is not None:
        spec = SpeculativeConfig(speculative_method="draft_model", num_speculative_tokens=4,
                                 spec_varlen=varlen, speculative_model=str(draft))
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(target), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        speculative=spec))


def test_draft_model_outputs_equal_plain_decoding(tiny_llama_dir, tmp_path, smollm2_tokenizer):
    other = save_tiny_llama(tmp_path / "draft", smollm2_tokenizer, seed=1)
    plain = make_llm(tiny_llama_dir)
    greedy = [PARAMS[0]] * len(PROMPTS)
    expected = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    expected_greedy = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
    llm = make_llm(tiny_llama_dir, other)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert llm.engine_core.spec.stats.num_draft_tokens > 0
    assert llm.engine_core.scheduler.kv_cache_manager.block_pool.num_free_blocks == 128

    llm = make_llm(tiny_llama_dir, other, varlen=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected

    same = make_llm(tiny_llama_dir, tiny_llama_dir)   # the target drafts itself
    outputs = same.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outputs] == expected_greedy
    stats = same.engine_core.spec.stats
    assert stats.num_draft_tokens > 20
    assert stats.num_accepted_tokens == stats.num_draft_tokens   # every greedy draft passes


def test_a_missing_draft_model_is_named_in_the_error(tiny_llama_dir, tmp_path):
    """A speculative model path that does not exist fails at start-up naming
    speculative_model, not the target."""
    with pytest.raises(FileNotFoundError, match="speculative_model=.*nonexistent"):
        make_llm(tiny_llama_dir, tmp_path / "nonexistent")
