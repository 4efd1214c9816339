"""One request must never kill the engine (engine/fault_isolation.py, `EngineCore._step_failed`):
a fault injected inside a step — in the model's forward for a poisoned prompt token, in the
runner for a chosen request at a chosen output token, or when a non-blocking step's future is
resolved — finishes that request with an error while the others in the same batch get exactly
their normal tokens, no KV block leaks, and later requests are served. A fault in every step (the
device is gone) ends the engine loudly after a bounded number of steps."""

import pytest
import torch

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.errors import EngineDeadError
from deepinfer.engine.fault_isolation import FaultIsolation
from deepinfer.engine.llm import LLM
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.sampling_params import SamplingParams
from tests.fault_injection import POISON, PoisonedForward

PROMPTS = [[1, 2, 3], list(range(100, 140)), [7] * 17, list(range(300, 309)),
           list(range(1000, 1062, 2)), [42]]
BAD_PROMPT = [11, 12, POISON, 13, 14]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NUM_BLOCKS = 256


def make_llm(model_dir, *, async_scheduling: bool) -> LLM:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=48,
                                  async_scheduling=async_scheduling))
    return LLM(config=config)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, async_scheduling=False)
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, async_scheduling=request.param)
    assert llm.engine_core.async_scheduling == request.param
    return llm


@pytest.fixture
def poisoned(llm, monkeypatch):
    model = llm.engine_core.executor.runner.model
    poison = PoisonedForward(model)
    monkeypatch.setattr(model, "forward", poison)
    return poison


def assert_no_leak(llm):
    core = llm.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert not core.has_unfinished_requests()
    assert pool.num_free_blocks == NUM_BLOCKS
    assert not core.scheduler.requests and not core.faults.suspects


def test_poisoned_prompt_in_a_batch_fails_alone(llm, poisoned, expected):
    prompts = PROMPTS[:3] + [BAD_PROMPT] + PROMPTS[3:]
    outputs = llm.generate(prompts, GREEDY)
    bad = outputs.pop(3)
    assert bad.finished and bad.finish_reason == "error" and bad.token_ids == []
    assert "RuntimeError: injected fault in the forward pass" in bad.error
    assert "request 3 failed inside an engine step" in bad.error
    assert [o.token_ids for o in outputs] == expected
    assert {o.finish_reason for o in outputs} == {"length"}
    faults = llm.engine_core.faults
    assert faults.num_failed_requests >= 1 and faults.failed_steps_in_a_row == 0
    assert_no_leak(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected  # served after


def test_fault_at_a_decode_position_fails_only_the_request_reaching_it(llm, monkeypatch,
                                                                      expected):
    """A 62-token prompt (ids 1000..1122, longer than all others) fails when the forward computes
    position 66, past every other request's last position: recomputing its prompt and first
    outputs alone succeeds, the step at position 66 alone fails."""
    model = llm.engine_core.executor.runner.model
    monkeypatch.setattr(model, "forward", PoisonedForward(model, fail_position=66))
    long_prompt = list(range(1000, 1124, 2))
    outputs = llm.generate(PROMPTS + [long_prompt], GREEDY)
    bad = outputs.pop()
    assert bad.finish_reason == "error" and len(bad.token_ids) <= 66 - 62 + 1
    assert [o.token_ids for o in outputs] == expected
    assert_no_leak(llm)


def fail_request_at(llm, monkeypatch, request_id: str, num_output_tokens: int, *,
                    on_resolve: bool = False) -> None:
    """Make the runner raise in the step that computes `request_id`'s output token number
    `num_output_tokens` (0-based), at launch or (on_resolve) when its future resolves."""
    runner = llm.engine_core.executor.runner
    prompt_len: dict[str, int] = {}

    def hit(scheduler_output) -> bool:
        before = {new.request_id: new.num_computed_tokens
                  for new in scheduler_output.scheduled_new_reqs}
        before.update({cached.request_id: cached.num_computed_tokens
                       for cached in scheduler_output.scheduled_cached_reqs})
        prompt_len.update({new.request_id: new.num_prompt_tokens
                           for new in scheduler_output.scheduled_new_reqs})
        if request_id not in before:
            return False
        end = before[request_id] + scheduler_output.num_scheduled_tokens[request_id]
        return end >= prompt_len[request_id] + num_output_tokens

    def wrap(method):
        def execute(scheduler_output, *args):
            if hit(scheduler_output) and not on_resolve:
                raise ValueError(f"injected fault for {request_id}")
            output = method(scheduler_output, *args)
            if hit(scheduler_output) and on_resolve:
                return FailingFuture(request_id)
            return output
        return execute

    monkeypatch.setattr(runner, "execute", wrap(runner.execute))
    monkeypatch.setattr(runner, "execute_async", wrap(runner.execute_async))


class FailingFuture:
    """A step's future whose result() raises (a device error surfacing at the next sync)."""

    def __init__(self, request_id):
        self.request_id = request_id

    def result(self) -> ModelRunnerOutput:
        raise RuntimeError(f"injected device error while {self.request_id} ran")

    def feed_rows(self, *args):   # the next step reads this step's ids on the device
        return self.result()


@pytest.mark.parametrize("on_resolve", [False, True], ids=["launch", "resolve"])
def test_request_failing_at_its_fifth_token_fails_alone(llm, monkeypatch, expected, on_resolve):
    fail_request_at(llm, monkeypatch, "2", 5, on_resolve=on_resolve)
    outputs = llm.generate(PROMPTS, GREEDY)
    bad = outputs.pop(2)
    assert bad.finish_reason == "error" and "injected" in bad.error
    assert bad.token_ids == expected[2][:len(bad.token_ids)] and len(bad.token_ids) <= 5
    assert [o.token_ids for o in outputs] == expected[:2] + expected[3:]
    assert_no_leak(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_fault_in_every_step_ends_the_engine_loudly(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, async_scheduling=True)
    model = llm.engine_core.executor.runner.model
    poison = PoisonedForward(model)
    model.forward = poison
    poison.always = True
    with pytest.raises(EngineDeadError, match="4 engine steps failed in a row"):
        llm.generate(PROMPTS, GREEDY)
    assert poison.calls == 4   # bounded: one batch, then suspects alone, then give up


def test_isolation_rules():
    faults = FaultIsolation(max_failed_steps_in_a_row=3)
    assert faults.step_failed({"a": 40, "b": 9, "c": 3}, RuntimeError("x")) is None
    assert faults.current({"a", "b", "c"}) == "a"
    faults.step_succeeded({"a": 32})           # a chunk alone, short of where it failed
    assert faults.current({"a", "b", "c"}) == "a" and faults.failed_steps_in_a_row == 0
    faults.step_succeeded({"a": 40})           # as far as the failed step, alone: cleared
    assert faults.current({"b", "c"}) == "b"
    assert faults.step_failed({"b": 9}, RuntimeError("x")) == "b"   # failed alone: the culprit
    assert faults.current({"c"}) == "c"
    assert faults.current(set()) is None and not faults.isolating  # finished meanwhile
    faults.step_failed({"d": 5, "e": 6}, RuntimeError("x"))
    with pytest.raises(EngineDeadError):
        faults.step_failed({"d": 5}, RuntimeError("x"))
    with pytest.raises(ValueError, match="must be >= 2"):
        FaultIsolation(max_failed_steps_in_a_row=1)


def test_a_sampling_value_the_sampler_cannot_pack_fails_its_request_only(llm, expected):
    """The fuzzing finding of issue 26: top_k = 2**63 does not fit the sampler's int64 row
    tensor. Set behind validation's back (the server validates it now), it must still cost
    only its own request."""
    bad = SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=12, ignore_eos=True)
    object.__setattr__(bad, "top_k", 2**63)
    object.__setattr__(bad, "fan_out", lambda: [bad])   # LLM.generate's clone would validate it
    outputs = llm.generate(PROMPTS + [PROMPTS[0]], [GREEDY] * len(PROMPTS) + [bad])
    assert outputs[-1].finish_reason == "error" and outputs[-1].token_ids == []
    assert outputs[-1].error.startswith(f"request {len(PROMPTS)} failed inside an engine step")
    assert [o.token_ids for o in outputs[:-1]] == expected
    assert_no_leak(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_with_async_steps_and_graphs_a_poisoned_prompt_fails_alone(tmp_path):
    """On the device the default is async steps and decode CUDA graphs: the poisoned prefill
    (an eager forward) fails, the step in flight is undone with it, the others' greedy tokens
    are those of a run without the bad prompt, and no block leaks."""
    import gc

    from transformers import LlamaConfig

    from tests.engine.test_gpu_engine import write_random_llama_dir

    config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model_dir = write_random_llama_dir(tmp_path / "llama", config)
    llm = LLM(config=EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "float32"},
        cache={"num_blocks": 128, "block_size": 16},
        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
        kv_transfer={"kv_store": "none"}))
    core = llm.engine_core
    assert core.async_scheduling and core.executor.runner.cuda_graphs is not None
    expected = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    model = core.executor.runner.model
    model.forward = PoisonedForward(model)
    outputs = llm.generate(PROMPTS[:3] + [BAD_PROMPT] + PROMPTS[3:], GREEDY)
    assert outputs.pop(3).finish_reason == "error"
    assert [o.token_ids for o in outputs] == expected
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == 128 and not core.has_unfinished_requests()
    del llm, core, model
    gc.collect()
    torch.cuda.empty_cache()
