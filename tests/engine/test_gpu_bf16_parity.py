"""The engine in bfloat16 on CUDA against HF transformers in bfloat16: greedy tokens over many
steps, on a small random Llama (the product's dtype on a GPU; test_gpu_engine.py holds the exact
float32 parity).

In bf16 two correct implementations round differently (summation order, fused kernels, the
attention's split-K), so a near-tie between two logits can go either way, and from there the two
continuations differ. The test states how much must agree:
1. exact: for at least MIN_EXACT_PROMPTS of the PROMPTS, the engine's NEW_TOKENS greedy tokens
   are HF's greedy tokens (`generate`, one prompt at a time), token for token. Few, on purpose:
   a random model's logits are near-Gaussian, whose top two differ by less than 0.03 of the RMS
   at ~10% of steps, so over 32 steps most continuations meet a near-tie (measured on the H200,
   2026-12-04: 2 of 8 exact); check 2 is the one that holds the engine to HF;
2. every step, every prompt: fed the engine's own tokens (teacher forcing), HF's logit of the
   token the engine chose is within TIE_MARGIN x the row's logit RMS of HF's largest logit, so
   the engine only ever departs from HF at a near-tie (bf16 logit differences between
   implementations are ~0.02-0.03 of the RMS per step: tests/engine/test_fused_llama_gpu.py; they
   compound along a continuation, and the largest departure on the H200, 2026-12-04, was 0.139
   of the RMS, once in 8 x 32 steps).
The engine runs as served: CUDA graphs for decode, mixed prefill / decode steps under a small
token budget, the default `KernelConfig`.
"""

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 37, 64, 18, 90, 11, 128, 3)
MIN_EXACT_PROMPTS = 1          # of the 8 (see the module docstring)
TIE_MARGIN = 0.2               # x the logit RMS of the row


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-weight HF Llama (3 layers, GQA) with a word-level tokenizer, saved in bf16;
    initializer_range 0.2 (as tests/tiny_models.py) so logits are peaked, not near-uniform."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("bf16-llama")
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).eval().save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1",
                            eos_token="t2").save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _engine_greedy(model_dir, prompts) -> list[list[int]]:
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "bfloat16"},
        cache={"gpu_memory_utilization": 0.05},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
        kv_transfer={"kv_store": "none"})
    llm = LLM(config=config)
    assert llm.engine_core.executor.runner.cuda_graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = [out.token_ids for out in llm.generate(prompts, params)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def test_bf16_greedy_tokens_match_hf_but_at_near_ties(model_dir):
    from transformers import LlamaForCausalLM

    prompts = _prompts()
    got = _engine_greedy(model_dir, prompts)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
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
            logits = hf(forced).logits[0, len(prompt) - 1:-1].float()   # [NEW_TOKENS, vocab]
            chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
            gap = (logits.max(dim=-1).values - chosen) / logits.pow(2).mean(-1).sqrt()
            departures += [(seq, step, round(float(g), 4)) for step, g in enumerate(gap)
                           if g > TIE_MARGIN]
    assert departures == [], f"(prompt, step, gap / logit RMS) beyond {TIE_MARGIN}"
    assert exact >= MIN_EXACT_PROMPTS, f"{exact} of {len(prompts)} prompts token-exact"
