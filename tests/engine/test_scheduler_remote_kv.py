"""Scheduler side of the KV store (no torch, no model): the WAITING_FOR_REMOTE_KV state, fetched
blocks admitted like prefix-cache hits (`kv_loads`), and the full prompt blocks each step
completes (`kv_saves`)."""

from deepinfer.engine.config import SchedulerConfig
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler

BLOCK = 4


def make_scheduler(num_blocks=32, budget=32, save=True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK), save_kv_blocks=save)


def make_request(request_id, num_prompt, first_token=0, **kv) -> Request:
    return Request(request_id, list(range(first_token, first_token + num_prompt)),
                   SamplingParams(max_tokens=2, ignore_eos=True), **kv)


def finish_step(scheduler, out) -> None:
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[i].num_computed_tokens == scheduler.requests[i].num_tokens
               else [] for i in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(ids, sampled, [None] * len(ids)))


def test_request_waits_for_remote_kv_while_others_run():
    scheduler = make_scheduler()
    loading, other = make_request("loading", 14), make_request("other", 5, first_token=100)
    scheduler.add_request(loading)
    scheduler.add_request(other)
    scheduler.wait_for_remote_kv("loading")
    assert loading.status == RequestStatus.WAITING_FOR_REMOTE_KV and not loading.is_finished
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["other"]
    assert scheduler.get_stats().num_waiting_reqs == 1
    finish_step(scheduler, out)

    scheduler.remote_kv_ready({"loading": (0, 3)})  # blocks 0..2 fetched (12 of 14 tokens)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["loading"] == 2 and loading.num_computed_tokens == 14
    new, = out.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and loading.num_cached_tokens == 12
    load, = out.kv_loads
    assert load.block_ids == new.block_ids[:3]
    assert load.block_hashes == loading.block_hashes[:3]
    # fetched blocks become ordinary prefix-cache blocks: a twin request hits them locally
    hits, num_hit_tokens = scheduler.kv_cache_manager.get_computed_blocks(make_request("twin", 14))
    assert [b.block_id for b in hits] == load.block_ids and num_hit_tokens == 12


def test_fetched_blocks_extend_local_hits_unless_there_is_a_gap():
    scheduler = make_scheduler(save=False)
    first = make_request("first", 9)            # leaves blocks 0, 1 in the local cache
    scheduler.add_request(first)
    while not first.is_finished:
        finish_step(scheduler, scheduler.schedule())
    second, third = make_request("second", 17), make_request("third", 17)
    third.prompt_token_ids[8:] = range(500, 509)   # shares only the 2 cached blocks
    for request in (second, third):
        scheduler.add_request(request)
        scheduler.wait_for_remote_kv(request.request_id)
    # second: blocks 2..3 were fetched (the store lookup started past the 2 local blocks)
    # third: the fetch claims to start at block 3, which does not touch the local prefix
    scheduler.remote_kv_ready({"second": (2, 2), "third": (3, 1)})
    out = scheduler.schedule()
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [16, 8]
    assert [len(load.block_ids) for load in out.kv_loads] == [2, 0]
    assert out.kv_saves == []


def test_abort_while_waiting_for_remote_kv_frees_nothing_and_forgets_it():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("gone", 14))
    scheduler.wait_for_remote_kv("gone")
    scheduler.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    scheduler.remote_kv_ready({"gone": (0, 3)})  # the fetch ends after the abort
    assert not scheduler.has_work() or scheduler.schedule().num_scheduled_tokens == {}
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 32
    assert not scheduler.requests and not scheduler.waiting


def test_saves_list_full_prompt_blocks_as_chunks_complete_them():
    scheduler = make_scheduler(budget=6)
    request = make_request("r", 14)
    scheduler.add_request(request)
    saved, saved_ids, saved_hashes = [], [], []
    while not request.is_finished:
        out = scheduler.schedule()
        saved.append([len(save.block_ids) for save in out.kv_saves])
        for save in out.kv_saves:
            saved_ids += save.block_ids
            saved_hashes += save.block_hashes
        finish_step(scheduler, out)
    # chunks of 6, 6, 2 tokens complete blocks {0}, {1, 2}, {}; output blocks are never saved
    assert saved[:3] == [[1], [2], []] and all(s == [] for s in saved[3:])
    assert saved_hashes == request.block_hashes[:3]
    assert len(set(saved_ids)) == 3


def test_handoff_request_also_saves_its_prefix_cache_hits():
    scheduler = make_scheduler()
    warm = make_request("warm", 9)
    scheduler.add_request(warm)
    while not warm.is_finished:
        finish_step(scheduler, scheduler.schedule())
    handoff = make_request("handoff", 9, kv_transfer_params={"do_remote_decode": True})
    scheduler.add_request(handoff)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8   # two local hits
    save, = out.kv_saves
    assert save.block_hashes == handoff.block_hashes[:2]        # saved again for the decode side


def test_preempted_requests_are_reported_once_and_fetched_ones_go_first():
    scheduler = make_scheduler(num_blocks=5, budget=64)
    first, second = make_request("first", 8), make_request("second", 8, first_token=50)
    scheduler.add_request(first)
    scheduler.add_request(second)
    finish_step(scheduler, scheduler.schedule())     # 2 blocks each, 1 token sampled each
    finish_step(scheduler, scheduler.schedule())     # both need a 3rd block: 1 is free
    assert scheduler.num_preemptions == 1
    preempted = scheduler.take_preempted()
    assert [r.request_id for r in preempted] == ["second"] and scheduler.take_preempted() == []
    scheduler.add_request(make_request("third", 3, first_token=90))
    scheduler.wait_for_remote_kv("second")
    scheduler.remote_kv_ready({"second": (0, 1)})
    assert [r.request_id for r in scheduler.waiting] == ["second", "third"]
