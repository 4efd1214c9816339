"""Scheduler: chunked prefill, budgets, preemption by recompute, stop rules (no torch, no model)."""

import pytest

from deepinfer.engine.config import SchedulerConfig
from deepinfer.engine.errors import QueueFullError
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_waiting=16,
                   threshold=0, caching=True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_waiting_requests=max_waiting,
                             long_prefill_token_threshold=threshold)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def make_request(request_id, num_prompt, max_tokens=4, first_token=0, **params) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({2**20}))


def run_step(scheduler, token_of=lambda request_id: 7):
    """One step with a fake runner that samples `token_of(id)` for rows that reached the end."""
    out = scheduler.schedule()
    req_ids, sampled = [], []
    for request_id, num_tokens in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        req_ids.append(request_id)
        done = request.num_computed_tokens == request.num_tokens
        sampled.append([token_of(request_id)] if done else [])
    runner_output = ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))
    return out, scheduler.update_from_output(out, runner_output)


def run_to_completion(scheduler, max_steps=100):
    """Yield each step's SchedulerOutput until every request has finished."""
    for _ in range(max_steps):
        if not scheduler.requests:
            return
        yield run_step(scheduler)[0]
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def test_chunked_prefill_under_token_budget():
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 40))
    out, outputs = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 16} and outputs == []
    assert len(out.scheduled_new_reqs[0].block_ids) == 4
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 16}
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 16
    out, outputs = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 8}
    assert outputs[0].new_token_ids == [7]
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1}  # now decoding


def test_decodes_first_then_prefill_fills_the_rest_of_the_budget():
    scheduler = make_scheduler(budget=10)
    scheduler.add_request(make_request("a", 3, max_tokens=10))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 20, first_token=100))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.total_num_scheduled_tokens == 10


def test_long_prefill_threshold_caps_one_chunk():
    scheduler = make_scheduler(budget=32, threshold=8)
    scheduler.add_request(make_request("a", 20))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 8}


def test_max_num_seqs_and_waiting_cap():
    """The waiting queue holds max_waiting_requests beyond the free running slots: a burst
    of max_num_seqs + max_waiting_requests on an idle scheduler is admitted (found by
    black-box testing: half of a 4-request burst was refused with 2 slots free)."""
    scheduler = make_scheduler(max_num_seqs=2, max_waiting=3)
    for i in range(5):
        scheduler.add_request(make_request(str(i), 4, first_token=10 * i))
    with pytest.raises(QueueFullError, match="2 free running slots and max_waiting_requests=3"):
        scheduler.add_request(make_request("x", 4))
    out, _ = run_step(scheduler)
    assert sorted(out.num_scheduled_tokens) == ["0", "1"]
    assert scheduler.get_stats().num_waiting_reqs == 3
    with pytest.raises(QueueFullError, match="0 free running slots"):
        scheduler.add_request(make_request("y", 4))


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks; decoding grows them
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    scheduler.add_request(make_request("a", 8, max_tokens=12))
    scheduler.add_request(make_request("b", 8, max_tokens=12, first_token=50))
    outs = list(run_to_completion(scheduler))
    preempted_seen = any("b" in out.finished_req_ids for out in outs)
    assert preempted_seen and scheduler.num_preemptions >= 1
    assert scheduler.requests == {}
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 6


def test_preempted_request_resumes_with_all_its_tokens():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=False)
    scheduler.add_request(make_request("a", 6, max_tokens=9))
    scheduler.add_request(make_request("b", 6, max_tokens=9, first_token=50))
    resumed = None
    for out in run_to_completion(scheduler):
        for new in out.scheduled_new_reqs:
            if len(new.token_ids) > new.num_prompt_tokens:
                resumed = new
    assert resumed is not None
    assert resumed.token_ids[:6] == list(range(50, 56)) or resumed.token_ids[:6] == list(range(6))
    assert resumed.token_ids[6:] == [7] * (len(resumed.token_ids) - 6)
    assert resumed.num_computed_tokens == 0


def test_stop_rules_eos_stop_token_ids_and_length():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 4, max_tokens=10))
    scheduler.add_request(make_request("stop_id", 4, max_tokens=10, first_token=20,
                                       stop_token_ids=[5]))
    scheduler.add_request(make_request("len", 4, max_tokens=2, first_token=40))
    tokens = {"eos": 2**20, "stop_id": 5, "len": 9}
    _, outputs = run_step(scheduler, token_of=tokens.get)
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in outputs}
    assert reasons == {"eos": ("stop", None), "stop_id": ("stop", 5), "len": (None, None)}
    _, outputs = run_step(scheduler, token_of=tokens.get)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("len", "length")]
    assert scheduler.kv_cache_manager.usage == 0.0


def test_min_tokens_suppresses_eos_stop():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=10, min_tokens=2))
    _, outputs = run_step(scheduler, token_of=lambda _: 2**20)
    assert outputs[0].finish_reason is None
    _, outputs = run_step(scheduler, token_of=lambda _: 2**20)
    assert outputs[0].finish_reason == "stop"


def test_abort_frees_blocks_at_once_and_tells_the_runner():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10, first_token=30))
    run_step(scheduler)
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.usage == 0.0
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_prefix_hit_skips_cached_tokens():
    scheduler = make_scheduler(block_size=4, budget=64)
    scheduler.add_request(make_request("a", 13))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 13))
    out, _ = run_step(scheduler)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens["b"] == 1
    assert scheduler.requests["b"].num_cached_tokens == 12
