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


# one API server process of several (server/api_servers.py): records `count` requests, then
# prints its /metrics text; prometheus_client reads PROMETHEUS_MULTIPROC_DIR at import
_API_SERVER = """
import os, sys
from deepinfer.engine.outputs import SchedulerStats
from deepinfer.server.metrics import ServerMetrics
per_rank = [SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
            SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5)]
stats = SchedulerStats(num_running_reqs=3, kv_cache_usage=0.375, per_rank=per_rank)
metrics = ServerMetrics(lambda: stats, "m", 64, os.environ["PROMETHEUS_MULTIPROC_DIR"])
for _ in range(int(sys.argv[1])):
    metrics.success("length")
    metrics.generation_tokens.inc(5)
    metrics.http_response("/v1/completions", 200)
sys.stdout.write(metrics.render().decode())
"""


def test_several_api_servers_sum_request_counts_and_report_engine_stats_once(tmp_path):
    """Multiprocess mode: each API server's counters live in the shared directory, so either
    process's /metrics sums them; the engine's gauges (the same core snapshot in each) and
    the per-rank DP gauges appear once, unsummed."""
    import os
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    texts = [subprocess.run([sys.executable, "-c", _API_SERVER, str(count)], env=env,
                            check=True, capture_output=True, text=True).stdout
             for count in (3, 4)]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(texts[1]) for s in f.samples}
    assert samples[("deepinfer:request_success_total",
                    (("finished_reason", "length"), ("model_name", "m")))] == 7
    assert samples[("deepinfer:generation_tokens_total", (("model_name", "m"),))] == 35
    assert samples[("deepinfer:http_requests_total", (
        ("model_name", "m"), ("route", "/v1/completions"), ("status_code", "200")))] == 7
    assert samples[("deepinfer:num_requests_running", (("model_name", "m"),))] == 3
    assert samples[("deepinfer:dp_rank_num_requests_running",
                    (("dp_rank", "1"), ("model_name", "m")))] == 1
    assert samples[("deepinfer:dp_rank_kv_cache_usage_perc",
                    (("dp_rank", "0"), ("model_name", "m")))] == 0.25
    assert texts[0].count("deepinfer:num_requests_running{") == 1
