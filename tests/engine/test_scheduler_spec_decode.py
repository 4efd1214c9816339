"""Scheduler with draft tokens (issue 25.3): decode rows of 1 + k tokens with lookahead blocks,
rollback of rejected positions, exact block accounting (no torch, no model).

A fake runner commits the target's tokens: `accept` drafts, then one more token.
"""

from test_scheduler import make_request, make_scheduler

from deepinfer.engine.kv_cache.manager import cdiv
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.request import RequestStatus

TARGET = 7   # the fake target's token where a draft is rejected


def verify_step(scheduler, drafts=None, accept=None):
    """Schedule (with `drafts`), then commit per row: its first `accept[id]` drafts (all when
    absent) and one target token; plain rows at their end sample TARGET."""
    if drafts:
        scheduler.update_draft_token_ids(drafts)
    out = scheduler.schedule()
    req_ids, sampled = [], []
    for request_id in out.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        scored = out.scheduled_spec_decode_tokens.get(request_id, [])
        req_ids.append(request_id)
        if request.num_computed_tokens != request.num_tokens + len(scored):
            sampled.append([])      # a prefill chunk short of the end
            continue
        num_accepted = (accept or {}).get(request_id, len(scored))
        sampled.append(scored[:num_accepted] + [TARGET])
    runner_output = ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))
    return out, scheduler.update_from_output(out, runner_output)


def blocks_of(scheduler, request_id):
    return scheduler.kv_cache_manager.req_to_blocks[request_id]


def test_a_decode_row_scores_its_drafts_in_lookahead_slots():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 6, max_tokens=20))
    verify_step(scheduler)                                       # prefill: 6 tokens + 1
    out, outputs = verify_step(scheduler, {"a": [11, 12, 13, 14]})
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13, 14]}
    assert out.total_num_scheduled_tokens == 5
    assert len(out.scheduled_cached_reqs[0].new_block_ids) == 1  # positions 6..10: 3 blocks
    request = scheduler.requests["a"]
    assert outputs[0].new_token_ids == [11, 12, 13, 14, TARGET]  # all accepted + bonus
    assert request.num_computed_tokens == 11 and request.num_tokens == 12
    assert request.spec_token_ids == []                          # drafts are used once
    assert len(blocks_of(scheduler, "a")) == 3


def test_without_drafts_nothing_changes():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=5))
    for _ in range(3):
        out, _ = verify_step(scheduler)
        assert out.scheduled_spec_decode_tokens == {} and out.scheduled_encoder_inputs == {}
        assert all(c.num_kept_block_ids is None for c in out.scheduled_cached_reqs)


def test_the_token_budget_and_the_token_limit_cut_drafts():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 6, max_tokens=20))
    scheduler.add_request(make_request("b", 5, max_tokens=20, first_token=100))
    verify_step(scheduler)                                       # a: 6, b: 2 of 5
    verify_step(scheduler)                                       # a: 1, b: 3
    out, _ = verify_step(scheduler, {"a": [1] * 10, "b": [2] * 5})
    assert out.num_scheduled_tokens == {"a": 8}                  # a takes the whole budget
    assert out.scheduled_spec_decode_tokens == {"a": [1] * 7}
    assert scheduler.requests["b"].spec_token_ids == [2] * 5    # not reached: kept

    scheduler = make_scheduler()
    request = make_request("c", 6, max_tokens=20)
    request.max_total_tokens = 10                                # 6 prompt + 4 outputs at most
    scheduler.add_request(request)
    verify_step(scheduler)                                       # 7 tokens now
    out, outputs = verify_step(scheduler, {"c": [1, 2, 3, 4]})
    assert out.scheduled_spec_decode_tokens == {"c": [1, 2]}     # 2 drafts + 1 token = 3 more
    assert outputs[0].new_token_ids == [1, 2, TARGET] and outputs[0].finish_reason == "length"


def test_drafts_of_a_request_still_in_prefill_are_dropped():
    scheduler = make_scheduler(budget=4)
    scheduler.add_request(make_request("a", 10, max_tokens=20))
    verify_step(scheduler)
    out, _ = verify_step(scheduler, {"a": [1, 2]})
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {}
    assert scheduler.requests["a"].spec_token_ids == []


def test_rejected_positions_roll_back_to_the_blocks_of_plain_decoding():
    """a scores 6 drafts and keeps 1; its twin decodes the same 2 tokens one at a time."""
    scheduler, twin = make_scheduler(block_size=4), make_scheduler(block_size=4)
    for s in (scheduler, twin):
        s.add_request(make_request("a", 6, max_tokens=20))
        verify_step(s)
    out, outputs = verify_step(scheduler, {"a": [TARGET, 3, 4, 5, 6, 8]}, accept={"a": 1})
    assert len(blocks_of(scheduler, "a")) == 2                   # 4 blocks for 13 positions
    verify_step(twin)                                            # held 2 of them
    verify_step(twin)
    request, twin_request = scheduler.requests["a"], twin.requests["a"]
    assert outputs[0].new_token_ids == [TARGET, TARGET]
    assert request.all_token_ids == twin_request.all_token_ids
    assert request.num_computed_tokens == twin_request.num_computed_tokens == 8
    pool, twin_pool = scheduler.kv_cache_manager.block_pool, twin.kv_cache_manager.block_pool
    assert pool.num_free_blocks == twin_pool.num_free_blocks
    assert [b.ref_cnt for b in blocks_of(scheduler, "a")] == [1, 1]
    assert all(b.block_hash is None for b in pool.blocks if b.ref_cnt == 0)  # no draft hashed
    assert request.block_hashes == twin_request.block_hashes[:len(request.block_hashes)]

    out, _ = verify_step(scheduler)                  # the runner is told to cut its table once
    assert out.scheduled_cached_reqs[0].num_kept_block_ids == 2
    assert out.scheduled_cached_reqs[0].new_block_ids != []      # position 8 opens block 3
    verify_step(twin)
    assert pool.num_free_blocks == twin_pool.num_free_blocks
    assert request.block_hashes == twin_request.block_hashes      # hashed once known
    assert set(pool.cached_block_hash_to_block) == set(twin_pool.cached_block_hash_to_block)
    out, _ = verify_step(scheduler)
    assert out.scheduled_cached_reqs[0].num_kept_block_ids is None


def test_a_block_holding_a_committed_token_is_kept():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 5, max_tokens=20))
    verify_step(scheduler)                                       # 6 tokens, 5 computed
    verify_step(scheduler, {"a": [1, 2, 3, 4]}, accept={"a": 3})  # positions 5..9, keep 5..8
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == 9
    assert len(blocks_of(scheduler, "a")) == cdiv(9, 4) == 3    # position 8 is in block 2


def test_stop_abort_and_preemption_during_verification_leak_no_block():
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=64)
    scheduler.add_request(make_request("a", 6, max_tokens=20, stop_token_ids=[12]))
    scheduler.add_request(make_request("b", 6, max_tokens=20, first_token=50))
    verify_step(scheduler)
    _, outputs = verify_step(scheduler, {"a": [11, 12, 13], "b": [1, 2]})
    stopped = {o.request_id: o for o in outputs}["a"]
    assert stopped.new_token_ids == [11, 12] and stopped.finish_reason == "stop"
    assert "a" not in scheduler.requests                         # a stop inside the drafts

    scheduler.add_request(make_request("c", 9, max_tokens=20, first_token=80))
    verify_step(scheduler)                                       # c runs beside b
    out, _ = verify_step(scheduler, {"b": [1] * 12})             # b's lookahead evicts c
    assert scheduler.num_preemptions == 1 and "c" not in out.num_scheduled_tokens
    assert out.scheduled_spec_decode_tokens == {"b": [1] * 12}
    scheduler.update_draft_token_ids({"b": [4, 4]})
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"b": [4, 4]}
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)   # aborted mid-verify
    req_ids = list(out.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(req_ids, [[4, 4, 4] if r == "b" else [] for r in req_ids],
                                      [None] * len(req_ids))
    assert scheduler.update_from_output(out, runner_output) == []
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 8
    assert scheduler._num_kept_block_ids == {}
