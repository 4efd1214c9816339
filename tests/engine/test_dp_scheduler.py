"""DPScheduler (engine/dp_scheduler.py): per-rank schedulers behind the Scheduler interface —
least-loaded placement that sticks, merged and per-rank outputs, stats (no torch, no model)."""

from test_scheduler import make_request, make_scheduler, run_step

from deepinfer.engine.dp_scheduler import DPScheduler, DPSchedulerOutput
from deepinfer.engine.request import RequestStatus


def test_requests_go_to_the_least_loaded_rank_and_stay_there():
    dp = DPScheduler([make_scheduler(num_blocks=64), make_scheduler(num_blocks=64),
                      make_scheduler(num_blocks=64)])
    for i in range(5):
        dp.add_request(make_request(f"r{i}", 6, max_tokens=3, first_token=100 * i))
    assert [dp.rank_of(f"r{i}") for i in range(5)] == [0, 1, 2, 0, 1]
    out, _ = run_step(dp)
    assert isinstance(out, DPSchedulerOutput) and len(out.per_rank) == 3
    assert set(out.per_rank[2].num_scheduled_tokens) == {"r2"}
    assert out.total_num_scheduled_tokens == 30 == sum(
        o.total_num_scheduled_tokens for o in out.per_rank)
    run_step(dp)   # decodes: each row on its own rank again
    assert [dp.rank_of(f"r{i}") for i in range(5)] == [0, 1, 2, 0, 1]   # stayed


def test_equal_request_counts_go_to_the_emptier_kv_cache():
    dp = DPScheduler([make_scheduler(num_blocks=16), make_scheduler(num_blocks=16)])
    dp.add_request(make_request("long", 40, max_tokens=8))
    dp.add_request(make_request("short", 3, max_tokens=8, first_token=500))
    run_step(dp)
    assert dp.load(0)[:1] == dp.load(1)[:1] == (1,) and dp.load(0)[1] > dp.load(1)[1]
    dp.add_request(make_request("next", 3, first_token=900))
    assert dp.rank_of("next") == 1


def test_outputs_split_by_rank_and_stats_add_up():
    dp = DPScheduler([make_scheduler(num_blocks=32), make_scheduler(num_blocks=16)])
    for i in range(4):
        dp.add_request(make_request(f"r{i}", 5, max_tokens=2))
    finished = []
    for _ in range(10):
        if not dp.has_work():
            break
        _, outputs = run_step(dp, token_of=lambda request_id: int(request_id[1:]))
        finished += [(o.request_id, o.new_token_ids) for o in outputs if o.finish_reason]
    assert sorted(finished) == [(f"r{i}", [i]) for i in range(4)]
    stats = dp.get_stats()
    assert [s.num_kv_blocks for s in stats.per_rank] == [32, 16] and stats.num_kv_blocks == 48
    assert stats.num_running_reqs == 0 and dp.num_unfinished_requests == 0
