"""Async scheduling (engine/async_step.py: the executor returns a future that the one step loop,
`EngineCore.step`, resolves a step later) forced on, on CPU: the same tokens as synchronous
steps for every way a request can end or be interrupted, and no KV block left behind."""

import pytest

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, env_overrides
from deepinfer.engine.llm import LLM
from deepinfer.engine.request import RequestStatus
from deepinfer.engine.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3], list(range(100, 140)), [7] * 17, list(range(300, 309)),
           list(range(1000, 1062, 2)), [42], list(range(5000, 5023)), list(range(9000, 9070))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def make_llm(model_dir, *, async_scheduling: bool, num_blocks=512, caching=True,
             budget=48) -> LLM:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                                  async_scheduling=async_scheduling))
    return LLM(config=config)


@pytest.fixture(scope="module")
def sync_llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, async_scheduling=False)


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, async_scheduling=True)
    assert llm.engine_core.async_scheduling
    return llm


def summary(outputs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outputs]


def assert_all_blocks_free(llm):
    core = llm.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert not core.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.scheduler.running and not core.scheduler.requests


def test_switch_defaults_off_on_cpu_and_reads_the_environment(sync_llm):
    assert SchedulerConfig().async_scheduling is None
    assert env_overrides({"DEEPINFER_ASYNC_SCHEDULING": "0"}) == {
        "scheduler": {"async_scheduling": False}}
    assert env_overrides({"DEEPINFER_ASYNC_SCHEDULING": "1"}) == {
        "scheduler": {"async_scheduling": True}}
    assert not sync_llm.engine_core.async_scheduling


def test_greedy_batch_equals_sync(sync_llm, async_llm):
    expected = summary(sync_llm.generate(PROMPTS, GREEDY))
    assert summary(async_llm.generate(PROMPTS, GREEDY)) == expected
    assert all(len(tokens) == 20 for tokens, *_ in expected)
    assert_all_blocks_free(async_llm)


def test_stop_rules_apply_one_step_late_with_the_same_result(sync_llm, async_llm):
    free_run = sync_llm.generate(PROMPTS, GREEDY)
    params = [
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        # a stop string taken from the free run's text, and a stop token id from its tokens
        SamplingParams(temperature=0.0, max_tokens=20, stop=[free_run[2].text[5:8]]),
        SamplingParams(temperature=0.0, max_tokens=20,
                       stop_token_ids=[free_run[3].token_ids[6]]),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4,
                       stop_token_ids=[free_run[4].token_ids[1]]),
        GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    expected = sync_llm.generate(PROMPTS, params)
    assert [o.finish_reason for o in expected[:4]] == ["length", "length", "stop", "stop"]
    assert summary(async_llm.generate(PROMPTS, params)) == summary(expected)
    assert_all_blocks_free(async_llm)


def test_eos_ends_requests_the_same_way(sync_llm, async_llm):
    free_run = sync_llm.generate(PROMPTS, GREEDY)
    eos = frozenset({free_run[1].token_ids[3], free_run[5].token_ids[9]})
    params = SamplingParams(temperature=0.0, max_tokens=20)
    results = []
    for llm in (sync_llm, async_llm):
        core = llm.engine_core
        saved = core.eos_token_ids
        core.eos_token_ids = eos
        try:
            results.append(summary(llm.generate(PROMPTS, params)))
        finally:
            core.eos_token_ids = saved
    assert results[0] == results[1]
    assert results[0][1][0] == free_run[1].token_ids[:4]  # ended by EOS, the token kept
    assert_all_blocks_free(async_llm)


def test_seeded_sampling_logprobs_and_n_copies_equal_sync(sync_llm, async_llm):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=seed % 3, max_tokens=12,
                             logprobs=2, ignore_eos=True) for seed in range(8)]
    prompts = [PROMPTS[1]] * 4 + PROMPTS[4:]          # n=4 copies of one prompt, and others
    expected = sync_llm.generate(prompts, params)
    got = async_llm.generate(prompts, params)
    assert summary(got) == summary(expected)
    # bitwise: on a loaded machine this held only with MKL_DYNAMIC off (engine/__init__.py)
    assert [[lp.top for lp in o.logprobs] for o in got] == [
        [lp.top for lp in o.logprobs] for o in expected]
    assert expected[0].token_ids == expected[3].token_ids != expected[1].token_ids
    assert_all_blocks_free(async_llm)


def test_preemption_gives_the_same_tokens_and_frees_every_block(tiny_llama_dir, sync_llm):
    expected = summary(sync_llm.generate(PROMPTS, GREEDY))
    tight = make_llm(tiny_llama_dir, async_scheduling=True, num_blocks=40, caching=False)
    assert summary(tight.generate(PROMPTS, GREEDY)) == expected
    assert tight.engine_core.scheduler.num_preemptions > 0
    assert_all_blocks_free(tight)


def test_prefix_cache_hit_gives_the_same_tokens(sync_llm, async_llm):
    expected = sync_llm.generate([PROMPTS[7]], GREEDY)[0].token_ids
    first = async_llm.generate([PROMPTS[7]], GREEDY)[0]
    second = async_llm.generate([PROMPTS[7]], GREEDY)[0]
    assert first.token_ids == second.token_ids == expected
    assert second.num_cached_tokens == 68
    assert_all_blocks_free(async_llm)


def test_abort_mid_run_and_reused_id_leave_no_stale_token(sync_llm, async_llm):
    expected = summary(sync_llm.generate(PROMPTS[:4], GREEDY))
    core = async_llm.engine_core
    for index, prompt in enumerate(PROMPTS[:4]):
        core.add_request(core.make_request(prompt, GREEDY, request_id=f"r{index}"))
    finished = {}
    for step in range(200):
        if step == 6:   # a step is in flight: abort one, reuse its id for another prompt
            assert core._in_flight
            core.abort_requests(["r1"])
            core.add_request(core.make_request(PROMPTS[1], GREEDY, request_id="r1"))
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        if not core.has_unfinished_requests():
            break
    assert summary(finished[f"r{i}"] for i in range(4)) == expected
    assert_all_blocks_free(async_llm)


def test_structured_output_and_penalties_fall_back_to_sync_steps(sync_llm, async_llm):
    params = [GREEDY,
              SamplingParams(temperature=0.0, max_tokens=12,
                             so_args={"schema_type": "regex", "schema": "[a-z]{2,6}"}),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3,
                             frequency_penalty=0.5, ignore_eos=True),
              GREEDY]
    expected = sync_llm.generate(PROMPTS[:4], params)
    got = async_llm.generate(PROMPTS[:4], params)
    assert summary(got) == summary(expected)
    assert got[1].finish_reason == "stop"   # the grammar ended it
    assert_all_blocks_free(async_llm)
    # plain requests after them run async again
    assert summary(async_llm.generate(PROMPTS[:2], GREEDY)) == summary(
        sync_llm.generate(PROMPTS[:2], GREEDY))
    assert not async_llm.engine_core._sync_ids


def test_requests_keep_no_placeholder_after_finishing(async_llm):
    core = async_llm.engine_core
    requests = [core.make_request(p, GREEDY) for p in PROMPTS[:3]]
    for request in requests:
        core.add_request(request)
    while core.has_unfinished_requests():
        core.step()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_output_tokens == 20 for r in requests)


def test_grammar_request_arriving_mid_run_drains_the_step_in_flight(sync_llm, async_llm):
    grammar = SamplingParams(temperature=0.0, max_tokens=10,
                             so_args={"schema_type": "regex", "schema": "[a-z]{2,6}"})
    expected = summary(sync_llm.generate(PROMPTS[:3], GREEDY)
                       + sync_llm.generate([PROMPTS[5]], grammar))
    core = async_llm.engine_core
    for index, prompt in enumerate(PROMPTS[:3]):
        core.add_request(core.make_request(prompt, GREEDY, request_id=f"g{index}"))
    finished, modes = {}, []
    for step in range(200):
        if step == 4:
            assert core._in_flight
            core.add_request(core.make_request(PROMPTS[5], grammar, request_id="g3"))
        modes.append(core._non_block() or bool(core._in_flight))
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        if not core.has_unfinished_requests():
            break
    assert summary(finished[f"g{i}"] for i in range(4)) == expected
    assert modes[4] and not modes[6]   # drained the step in flight, then ran sync steps
    assert_all_blocks_free(async_llm)


def test_async_llm_streams_and_an_aborted_stream_frees_its_blocks(tiny_llama_dir, sync_llm):
    import asyncio

    from deepinfer.engine.async_llm import AsyncLLM

    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(async_scheduling=True))
    engine = AsyncLLM(config)
    expected = sync_llm.generate([PROMPTS[3]], GREEDY)[0].token_ids

    async def run():
        async def leave_after_two():
            seen = 0
            stream = engine.generate(PROMPTS[7], SamplingParams(max_tokens=200,
                                                                ignore_eos=True))
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.aclose()

        async def complete():
            tokens = []
            async for output in engine.generate(PROMPTS[3], GREEDY):
                tokens.extend(output.new_token_ids)
            return tokens

        _, tokens = await asyncio.gather(leave_after_two(), complete())
        for _ in range(100):
            stats = engine.get_stats()
            if stats.num_running_reqs == 0 and stats.num_free_kv_blocks == 256:
                break
            await asyncio.sleep(0.02)
        return tokens, engine.get_stats()

    try:
        tokens, stats = asyncio.run(run())
    finally:
        engine.shutdown()
    assert tokens == expected
    assert stats.num_running_reqs == 0 and stats.num_free_kv_blocks == 256
