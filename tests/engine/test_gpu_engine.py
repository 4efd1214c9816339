"""The whole engine on CUDA vs HF transformers, greedy, on a small random Llama.

Parity is checked in float32 (bf16 greedy parity over many steps is fragile: one rounding flip
changes every later token), with TF32 matmuls off on both sides: the generated token ids must be
identical, with CUDA graphs (decode replays, padded batch sizes) and eagerly. Prompts of
different lengths with a small step-token budget make the scheduler mix prefill chunks and
decode tokens in one step (the Triton varlen prefill kernel) before decode-only steps take over
(graphs). The KV cache is sized by the profiling pass (`gpu_memory_utilization`). A bf16 run
checks the bf16 path end to end against HF bf16 on the first generated token only.
"""

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 37, 64, 18, 90)  # 5 sequences: decode pads to the captured size 8


def write_random_llama_dir(path, config, seed: int = 0, model=None):
    """Save a random-weight HF Llama (or the given HF `model`, of `config`) with a word-level
    tokenizer ("t0".."t{V-1}") at `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1", eos_token="t2")
    torch.manual_seed(seed)
    (model if model is not None else LlamaForCausalLM(config).eval()).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return write_random_llama_dir(tmp_path_factory.mktemp("gpu-llama"), config)


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
    gc.collect()
    torch.cuda.empty_cache()


def _prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir, prompts, dtype, max_new_tokens):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:  # one at a time: no padding in the reference
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


def _engine_greedy(model_dir, prompts, *, dtype, enforce_eager, max_new_tokens):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": dtype,
               "enforce_eager": enforce_eager},
        cache={"gpu_memory_utilization": 0.05},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
        kv_transfer={"kv_store": "none"})
    llm = LLM(config=config)
    runner = llm.engine_core.executor.runner
    assert runner.kv_caches[0].is_cuda and runner.kv_caches[0].dtype == getattr(torch, dtype)
    assert (runner.cuda_graphs is None) == enforce_eager
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    del llm, runner
    gc.collect()
    return [out.token_ids for out in outputs]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_tokens_match_hf_float32(model_dir, enforce_eager):
    prompts = _prompts()
    expected = _hf_greedy(model_dir, prompts, torch.float32, MAX_NEW_TOKENS)
    got = _engine_greedy(model_dir, prompts, dtype="float32", enforce_eager=enforce_eager,
                         max_new_tokens=MAX_NEW_TOKENS)
    assert got == expected


def test_bfloat16_first_token_matches_hf(model_dir):
    prompts = _prompts()
    expected = _hf_greedy(model_dir, prompts, torch.bfloat16, 1)
    got = _engine_greedy(model_dir, prompts, dtype="bfloat16", enforce_eager=False,
                         max_new_tokens=4)
    assert [tokens[:1] for tokens in got] == expected
    assert all(len(tokens) == 4 for tokens in got)


def _engine_run(model_dir, prompts, params, *, async_scheduling, num_blocks):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.llm import LLM

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "float32"},
        cache={"num_blocks": num_blocks, "block_size": 16, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8,
                   "async_scheduling": async_scheduling},
        kv_transfer={"kv_store": "none"})
    llm = LLM(config=config)
    core = llm.engine_core
    assert core.async_scheduling == async_scheduling
    outputs = llm.generate(prompts, params)
    pool = core.scheduler.kv_cache_manager.block_pool
    result = ([(o.token_ids, o.finish_reason, o.stop_reason) for o in outputs],
              core.scheduler.num_preemptions, pool.num_free_blocks)
    del llm, core
    gc.collect()
    return result


def test_async_scheduling_gives_the_sync_tokens_and_frees_every_block(model_dir):
    """Async steps (the default on CUDA: decode ids gathered on the device, stop rules one
    step late) against sync steps: greedy, seeded random with logprobs, max_tokens, stop token
    ids, under preemption (12 blocks of 16 tokens; the longest request needs 8)."""
    from deepinfer.engine.sampling_params import SamplingParams

    prompts = _prompts() * 2
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=24, logprobs=1,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[7, 11, 13, 17]),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    sync = _engine_run(model_dir, prompts, params, async_scheduling=False, num_blocks=12)
    overlapped = _engine_run(model_dir, prompts, params, async_scheduling=True, num_blocks=12)
    assert overlapped[0] == sync[0]
    assert overlapped[1] > 0 and overlapped[2] == 12 and sync[2] == 12
