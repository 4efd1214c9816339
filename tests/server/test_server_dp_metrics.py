"""/metrics with attention data parallelism: one scrape, each rank's gauges labelled dp_rank."""

from prometheus_client import generate_latest

from deepinfer.engine.outputs import SchedulerStats
from deepinfer.server.metrics import ServerMetrics


def test_per_rank_gauges_carry_a_dp_rank_label():
    per_rank = [SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25),
                SchedulerStats(num_running_reqs=0, num_waiting_reqs=3, kv_cache_usage=0.5)]
    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=4, kv_cache_usage=0.375,
                           per_rank=per_rank)
    text = generate_latest(ServerMetrics(lambda: stats, "m", 64).registry).decode()
    assert 'deepinfer:num_requests_running{model_name="m"} 2.0' in text
    assert 'deepinfer:dp_rank_num_requests_running{dp_rank="0",model_name="m"} 2.0' in text
    assert 'deepinfer:dp_rank_num_requests_waiting{dp_rank="1",model_name="m"} 3.0' in text
    assert 'deepinfer:dp_rank_kv_cache_usage_perc{dp_rank="1",model_name="m"} 0.5' in text
    one_rank = generate_latest(ServerMetrics(SchedulerStats, "m", 64).registry).decode()
    assert "dp_rank" not in one_rank
