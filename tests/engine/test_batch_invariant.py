"""Batch-invariant mode (`KernelConfig.batch_invariant`) on the CPU, whole engine, tiny random
Llama: a request's token ids and logprob floats (its own and the top-5 alternatives') are the
same bits alone, inside a batch of 64 mixed requests, under chunked prefill, after a prefix-cache
hit, after a KV-store load from Redis, after preemption, and (SmolLM2, whose n-gram drafts pass:
the tiny model's rarely do) with speculative decoding on (varlen and fixed length) or off.
Greedy and seeded requests alike."""

import pytest
import torch

from deepinfer.engine.batch_invariant import check_batch_invariant
from deepinfer.engine.config import EngineConfig, KernelConfig
from deepinfer.engine.llm import LLM
from deepinfer.engine.models.deepseek import DeepseekV3ForCausalLM
from deepinfer.engine.models.layers.linear import Linear
from deepinfer.engine.models.llama import LlamaForCausalLM
from deepinfer.engine.models.llava import LlavaForConditionalGeneration
from deepinfer.engine.sampling_params import SamplingParams

BLOCK = 4
F32 = torch.float32
# the requests whose outputs are compared: (prompt ids, sampling params)
TARGETS = [
    (list(range(100, 137)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                           logprobs=5)),
    ([9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8], SamplingParams(
        temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=5)),
    (list(range(3000, 3070, 3)), SamplingParams(temperature=1.2, top_k=20, seed=5,
                                                max_tokens=20, ignore_eos=True, logprobs=5)),
    ([42], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)),
]


def make_llm(model_dir, *, block_size=BLOCK, **fields) -> LLM:
    options = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=block_size,
                   num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048,
                   batch_invariant=True)
    options.update(fields)
    return LLM(config=EngineConfig().with_fields(**options))


def signature(output) -> tuple:
    """(token ids, per token (id, logprob, rank, top-5)): what must match bit for bit."""
    choice = output.outputs[0]
    return tuple(choice.token_ids), tuple(
        (t.token_id, t.logprob, t.rank, tuple(t.top)) for t in choice.logprobs or ())


def run(llm: LLM, requests) -> list[tuple]:
    prompts, params = zip(*requests)
    return [signature(o) for o in llm.generate(list(prompts), list(params))]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """Each target by itself, no prefix caching, one prefill chunk."""
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    return [run(llm, [target])[0] for target in TARGETS]


def mixed_batch(size: int, targets=TARGETS, token_ids=(200, 20000), max_prompt=90) -> list:
    """`size` requests of mixed lengths (up to `max_prompt` random ids in the range
    `token_ids`) and sampling, the `targets` spread among them."""
    generator = torch.Generator().manual_seed(0)
    requests = []
    for i in range(size - len(targets)):
        length = int(torch.randint(1, max_prompt, (1,), generator=generator))
        prompt = torch.randint(*token_ids, (length,), generator=generator).tolist()
        params = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7, seed=i,
                                max_tokens=int(torch.randint(4, 30, (1,), generator=generator)),
                                ignore_eos=True, logprobs=2 if i % 2 else None)
        requests.append((prompt, params))
    for j, target in enumerate(targets):
        requests.insert(j * (size // len(targets)) + 3, target)
    return requests


def targets_of(requests, results, targets=TARGETS) -> list[tuple]:
    """The results of `targets` (the same objects) among `requests`, in targets' order."""
    ids = {id(t) for t in targets}
    by_target = {id(r): s for r, s in zip(requests, results) if id(r) in ids}
    return [by_target[id(t)] for t in targets]


def test_alone_equals_inside_a_batch_of_64_mixed_requests(tiny_llama_dir, alone):
    requests = mixed_batch(64)
    llm = make_llm(tiny_llama_dir)
    assert targets_of(requests, run(llm, requests)) == alone
    assert all(len(ids) == 20 for ids, _ in alone)
    # the mode's linears never read a oneDNN copy, so none is kept
    model = llm.engine_core.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is None for m in linears)


def test_chunked_prefill_equals_one_chunk(tiny_llama_dir, alone):
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    requests = mixed_batch(16)
    assert targets_of(requests, run(llm, requests)) == alone


def test_prefix_cache_hit_equals_cold(tiny_llama_dir, alone):
    llm = make_llm(tiny_llama_dir)
    warm = [(prompt[:-3] + [5, 5, 5], SamplingParams(max_tokens=1)) for prompt, _ in TARGETS]
    llm.generate([p for p, _ in warm], [s for _, s in warm])
    outputs = llm.generate([p for p, _ in TARGETS], [s for _, s in TARGETS])
    assert [signature(o) for o in outputs] == alone
    assert outputs[0].num_cached_tokens >= 32        # the 37-token prompt's first 8 blocks


def test_preemption_and_recompute_equal_uninterrupted(tiny_llama_dir, alone):
    llm = make_llm(tiny_llama_dir, num_blocks=48, enable_prefix_caching=False)
    requests = mixed_batch(12)
    results = run(llm, requests)
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert targets_of(requests, results) == alone


GROUNDED = ["Copy the list. apple, banana, cherry, date, elderberry, fig, grape, kiwi, lemon, "
            "mango. Copy: apple, banana, cherry,",
            "The code is 1 2 3 4 5 6 7 8 9 10 11 12. Again, the code is 1 2 3"]


def test_speculation_with_accepted_drafts_equals_plain_on_smollm2(smollm2_dir):
    """SmolLM2 on prompts it continues from their own text, so n-gram drafts are accepted:
    outputs and logprobs equal those of plain decoding, at fixed length and varlen."""
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True,
                             logprobs=3)]
    requests = [(prompt, p) for prompt in GROUNDED for p in params]
    options = dict(block_size=16, num_blocks=256, max_num_seqs=8)
    plain = run(make_llm(smollm2_dir, **options), requests)
    for varlen in (False, True):
        llm = make_llm(smollm2_dir, speculative_method="ngram", num_speculative_tokens=4,
                       spec_varlen=varlen, **options)
        assert run(llm, requests) == plain
        if not varlen:
            assert llm.engine_core.get_stats().spec_decode.num_accepted_tokens > 8


def run_core(llm: LLM, requests, kv_transfer_params) -> list:
    """Each request through `llm`'s engine core with `kv_transfer_params` (one per request);
    finished outputs in order, after the block saves landed."""
    core = llm.engine_core
    for i, ((prompt, params), transfer) in enumerate(zip(requests, kv_transfer_params)):
        core.add_request(core.make_request(prompt, params, f"t{i}", kv_transfer_params=transfer))
    finals = {}
    while core.has_unfinished_requests():
        finals.update({o.request_id: o for o in core.step() if o.finished})
    core.kv_transfer.flush()
    return [finals[f"t{i}"] for i in range(len(requests))]


def test_kv_store_load_from_redis_equals_cold(tiny_llama_dir, alone, redis_server):
    """A prefill worker stores the prompts' blocks in Redis; a decode worker loads them and
    generates: the same bits as one engine computing everything."""
    prefill = make_llm(tiny_llama_dir, kv_store=redis_server.url, role="prefill")
    first = [(p, SamplingParams(**{**vars(s), "max_tokens": 1})) for p, s in TARGETS]
    handed = run_core(prefill, first, [{"do_remote_decode": True}] * len(TARGETS))
    assert [o.token_ids[0] for o in handed] == [ids[0] for ids, _ in alone]
    decode = make_llm(tiny_llama_dir, kv_store=redis_server.url, role="decode")
    outputs = run_core(decode, TARGETS, [o.kv_transfer_params for o in handed])
    assert outputs[0].num_cached_tokens >= 32     # loaded from Redis, not recomputed
    assert [signature(o) for o in outputs] == alone


def config_of(model_class: type):
    """An HF config naming `model_class` as its architecture."""
    from transformers import PretrainedConfig

    return PretrainedConfig(architectures=[model_class.__name__])


def test_refused_where_it_is_not_kept(monkeypatch):
    on, cpu, cuda = KernelConfig(batch_invariant=True), torch.device("cpu"), torch.device("cuda")
    llama, v3 = config_of(LlamaForCausalLM), config_of(DeepseekV3ForCausalLM)
    check_batch_invariant(on, cpu, F32, llama)                       # no error
    check_batch_invariant(KernelConfig(), cpu, F32, v3)              # the mode off: no check
    with pytest.raises(ValueError, match="CPU runs float32 only .* not bfloat16"):
        check_batch_invariant(on, cpu, torch.bfloat16, llama)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM on cpu yet .*CUDA only"):
        check_batch_invariant(on, cpu, F32, v3)
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration on cpu yet"):
        check_batch_invariant(on, cpu, F32, config_of(LlavaForConditionalGeneration))
    with pytest.raises(ValueError, match="LlamaForCausalLM on mps yet"):
        check_batch_invariant(on, torch.device("mps"), F32, llama)
    with pytest.raises(ValueError, match="no FP8 block-scaled GEMM form"):
        check_batch_invariant(KernelConfig(batch_invariant=True, fp8_block_gemm=True), cuda, F32,
                              v3)
    import deepinfer.engine.batch_invariant as module

    monkeypatch.setattr(module, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton"):
        check_batch_invariant(on, cuda, F32, llama)


def test_the_mode_is_off_by_default_and_set_by_its_variable(monkeypatch):
    from deepinfer.engine.config import config_from, env_overrides

    assert not EngineConfig().kernel.batch_invariant
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert config_from(env_overrides()).kernel.batch_invariant
