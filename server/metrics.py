"""Prometheus metrics named like vLLM's, prefixed `deepinfer:`, labelled with `model_name`.

Two sources:
- The engine's gauges and counters (running/waiting requests, KV cache usage, prefix cache,
  preemptions) are read from `engine.get_stats()` at scrape time by a custom collector: no
  polling thread, never stale.
- `deepinfer:http_requests_total{route,status_code}`: every HTTP answer, counted by
  `HTTPMetricsMiddleware` in `server.app` (the error-rate alert's numerator).
- Per-request counters and histograms (tokens, finish reasons, TTFT, inter-token latency,
  end-to-end latency, prompt/generation lengths) are recorded by a `RequestTracker` as the
  server consumes each engine request's outputs.

Each app owns a `CollectorRegistry` (not the process-global one), so tests can build several.
Time buckets span 1 ms to ~20 min, so GPU and CPU speeds both land inside them.

Several API server processes (`--api-server-count`, server/api_servers.py): prometheus_client's
multiprocess mode. The launcher points `PROMETHEUS_MULTIPROC_DIR` at a private directory before
it spawns them, so each process's per-request counters and histograms live in files there and
`/metrics` of any API server sums them (`multiprocess_dir`); the engine's own stats are not
summed: each API server holds the same snapshot of the one engine core and reports it once.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

from deepinfer.engine.outputs import KVStoreStats, RequestOutput, SchedulerStats, SpecDecodeStats

logger = logging.getLogger("deepinfer.server")

TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0]
ITL_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS_S = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0]


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context window (vLLM's 1-2-5 series)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return [float(b) for b in buckets]
            buckets.append(value)
        scale *= 10


class _EngineStatsCollector:
    """Gauges and engine-side counters, from one `get_stats()` snapshot per scrape."""

    def __init__(self, get_stats: Callable[[], SchedulerStats], model_name: str) -> None:
        self._get_stats = get_stats
        self._labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._get_stats()
        except Exception:  # a dead engine must not break /metrics; /health reports it
            logger.exception("engine.get_stats() failed during a /metrics scrape")
            return
        yield self._gauge("deepinfer:num_requests_running",
                          "Requests in the running batch.", stats.num_running_reqs)
        yield self._gauge("deepinfer:num_requests_waiting",
                          "Requests waiting to be scheduled.", stats.num_waiting_reqs)
        yield self._gauge("deepinfer:kv_cache_usage_perc",
                          "Fraction of KV cache blocks in use (0..1).", stats.kv_cache_usage)
        yield self._counter("deepinfer:prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_cache_queries)
        yield self._counter("deepinfer:prefix_cache_hits",
                            "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        yield self._counter("deepinfer:num_preemptions",
                            "Requests preempted (recomputed later) for lack of KV blocks.",
                            stats.num_preemptions)
        kv_store = stats.kv_store
        if kv_store is not None:
            yield from self._kv_store_metrics(kv_store)
        mm = getattr(stats, "mm_encoder", None)
        if mm is not None:
            yield from self._mm_encoder_metrics(mm)
        if stats.per_rank:
            yield from self._per_rank_metrics(stats.per_rank)
        # exported at zero when speculative decoding is off, so dashboards never go blank
        yield from self._spec_decode_metrics(stats.spec_decode or SpecDecodeStats())

    def _mm_encoder_metrics(self, mm) -> Iterator[Metric]:
        """A vision-language model's image encoder (engine/mm_encoder.py)."""
        for name, doc, value in (
                ("images_encoded", "Images run through the vision encoder.", mm.images_encoded),
                ("cache_hits", "Image embeddings served by the encoder cache.", mm.cache_hits),
                ("encode_seconds", "Seconds spent encoding images.", mm.encode_seconds),
                ("store_hits", "Image embeddings loaded from the KV store.", mm.store_hits),
                ("store_misses", "Image embeddings looked up in the KV store and encoded "
                                 "instead (absent, corrupt or store down).", mm.store_misses),
                ("store_corrupt", "Of the store misses: stored embeddings that failed their "
                                  "checksum, version or layout check.", mm.store_corrupt),
                ("store_saves", "Image embeddings written to the KV store.", mm.store_saves)):
            yield self._counter(f"deepinfer:mm_encoder_{name}", doc, value)
        yield self._gauge("deepinfer:mm_encoder_cache_bytes",
                          "Bytes held by the encoder cache.", mm.cache_bytes)

    def _per_rank_metrics(self, per_rank: list[SchedulerStats]) -> Iterator[Metric]:
        """Attention data parallelism: each rank's own requests and KV cache (label dp_rank)."""
        for name, doc, attr in (
                ("num_requests_running", "Requests in the running batch of one DP rank.",
                 "num_running_reqs"),
                ("num_requests_waiting", "Requests waiting on one DP rank.", "num_waiting_reqs"),
                ("kv_cache_usage_perc", "Fraction of one DP rank's KV cache blocks in use "
                                        "(0..1).", "kv_cache_usage")):
            family = GaugeMetricFamily(f"deepinfer:dp_rank_{name}", doc,
                                       labels=["model_name", "dp_rank"])
            for rank, stats in enumerate(per_rank):
                family.add_metric(self._labels + [str(rank)], getattr(stats, attr))
            yield family

    def _spec_decode_metrics(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """Speculative decoding (engine/spec/), vLLM's names: acceptance rate =
        accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
        for name, doc, value in (
                ("num_drafts", "Verify rows that carried at least one draft token.",
                 spec.num_drafts),
                ("num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
                ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
            yield self._counter(f"deepinfer:spec_decode_{name}", doc, value)
        family = CounterMetricFamily(
            "deepinfer:spec_decode_num_accepted_tokens_per_pos",
            "Verify rows whose draft at this 0-based position was accepted.",
            labels=["model_name", "position"])
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric(self._labels + [str(position)], count)
        yield family

    def _kv_store_metrics(self, kv: KVStoreStats) -> Iterator[Metric]:
        """The KV block store's traffic (engine/kv_transfer.py), when a store is configured."""
        for name, doc, value in (
                ("hits", "KV blocks loaded from the KV store.", kv.hits),
                ("misses", "KV blocks looked up in the KV store and recomputed instead "
                           "(absent, corrupt or store down).", kv.misses),
                ("corrupt_blocks", "Of the misses: stored blocks that failed their checksum, "
                                   "version or layout check.", kv.corrupt),
                ("errors", "KV store operations that failed (unreachable, timeout).", kv.errors),
                ("loaded_bytes", "KV bytes loaded from the KV store.", kv.bytes_loaded),
                ("saved_bytes", "KV bytes saved to the KV store.", kv.bytes_saved),
                ("saved_blocks", "KV blocks saved to the KV store.", kv.blocks_saved)):
            yield self._counter(f"deepinfer:kv_store_{name}", doc, value)
        for kind, counts, total_s in (("load", kv.load_latency_counts, kv.load_latency_sum_s),
                                      ("save", kv.save_latency_counts, kv.save_latency_sum_s)):
            family = HistogramMetricFamily(
                f"deepinfer:kv_store_{kind}_latency_seconds",
                f"Time of one KV store {kind} (a request's prefix fetch, or one step's blocks "
                "of a request saved), encoding included.", labels=["model_name"])
            bounds = [str(b) for b in kv.latency_buckets_s] + ["+Inf"]
            family.add_metric(self._labels, list(zip(bounds, counts)), total_s)
            yield family


class ServerMetrics:
    """The app's registry plus the per-request instruments, bound to one model name."""

    def __init__(self, get_stats: Callable[[], SchedulerStats], model_name: str,
                 max_model_len: int, multiprocess_dir: str | None = None) -> None:
        """multiprocess_dir: prometheus_client's `PROMETHEUS_MULTIPROC_DIR` of this process
        (set before prometheus_client was imported) when several API servers share the
        counts; None: this process's counts alone."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(get_stats, model_name))
        reg, labels = self.registry, ["model_name"]
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
            reg = None   # the instruments write to their files; the collector reads them all
        self.prompt_tokens = Counter("deepinfer:prompt_tokens", "Prefill tokens processed.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("deepinfer:generation_tokens",
                                         "Generation tokens produced.", labels,
                                         registry=reg).labels(model_name)
        self._success = Counter("deepinfer:request_success", "Finished requests by reason.",
                                labels + ["finished_reason"], registry=reg)
        self._model_name = model_name
        # route = the matched path template (never the raw path: bounded label values)
        self._http = Counter("deepinfer:http_requests", "HTTP answers by route and status code.",
                             labels + ["route", "status_code"], registry=reg)
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds",
                              "Time to first token (arrival to first sampled token).", labels,
                              buckets=TTFT_BUCKETS_S, registry=reg).labels(model_name)
        self.itl = Histogram("deepinfer:inter_token_latency_seconds",
                             "Time between successive engine outputs of one request.", labels,
                             buckets=ITL_BUCKETS_S, registry=reg).labels(model_name)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds",
                             "Arrival to finish of one engine request.", labels,
                             buckets=E2E_BUCKETS_S, registry=reg).labels(model_name)
        lengths = token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "deepinfer:request_prompt_tokens", "Prompt length of each request.", labels,
            buckets=lengths, registry=reg).labels(model_name)
        self.request_generation_tokens = Histogram(
            "deepinfer:request_generation_tokens", "Generated length of each request.", labels,
            buckets=lengths, registry=reg).labels(model_name)

    def success(self, finished_reason: str) -> None:
        self._success.labels(self._model_name, finished_reason).inc()

    def http_response(self, route: str, status_code: int) -> None:
        self._http.labels(self._model_name, route, str(status_code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Records one engine request's metrics from its stream of `RequestOutput`s.

    `observe` every output; `close` once when the stream ends (a request that ended without a
    finished output, e.g. a client disconnect, is counted as `abort`, also one aborted while
    it waited for its first step).
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._arrival_time: float | None = None
        self._last_token_time: float | None = None
        self._num_prompt_tokens = 0
        self._num_generated = 0
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self._arrival_time is None:
            self._arrival_time = out.metrics.arrival_time
            self._num_prompt_tokens = len(out.prompt_token_ids)
            self._m.prompt_tokens.inc(self._num_prompt_tokens)
        if out.new_token_ids:
            token_time = out.metrics.last_token_time or now
            if self._last_token_time is None:
                first = out.metrics.first_token_time or token_time
                self._m.ttft.observe(max(first - self._arrival_time, 0.0))
            else:
                self._m.itl.observe(max(token_time - self._last_token_time, 0.0))
            self._last_token_time = token_time
            self._num_generated += len(out.new_token_ids)
            self._m.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self._finish(out.finish_reason or "stop", out.metrics.finished_time or now)

    def close(self, count_unstarted: bool = True) -> None:
        """End the stream. `count_unstarted=False`: a request with no output yet is not
        counted (the engine refused it, e.g. a full queue: it was never queued)."""
        if self._done:
            return
        if self._arrival_time is not None:
            self._finish("abort", time.monotonic())
        elif count_unstarted:   # aborted while waiting: no output, no timings to record
            self._done = True
            self._m.success("abort")

    def _finish(self, reason: str, finished_time: float) -> None:
        if self._done:
            return
        self._done = True
        self._m.success(reason)
        self._m.e2e.observe(max(finished_time - (self._arrival_time or finished_time), 0.0))
        self._m.request_prompt_tokens.observe(self._num_prompt_tokens)
        self._m.request_generation_tokens.observe(self._num_generated)
