"""The router's Prometheus metrics, prefixed `deepinfer_router:`, in a registry of its own.

Per backend (label `backend` = the worker's base URL):
- `deepinfer_router:requests_total{backend,status_code}`: answers received from workers;
- `deepinfer_router:request_duration_seconds{backend}`: from sending to the last byte relayed;
- `deepinfer_router:time_to_first_byte_seconds{backend}`: from sending to the answer's header;
- `deepinfer_router:retries_total{backend}`: requests moved to another replica because the
  connection to this one failed, or the health checks ejected it, before any byte of the
  answer;
- `deepinfer_router:ejections_total{backend}`: healthy -> ejected transitions;
- `deepinfer_router:backend_healthy{backend,role}` and
  `deepinfer_router:backend_outstanding_requests{backend,role}`: read from the registry at
  scrape time (a replica that left a discovered pool stays, healthy 0, while it drains).
A replica that leaves a discovered pool for good takes its series with it (`forget_backend`), so
pod churn does not grow the label sets without bound.
Router-wide: `deepinfer_router:client_requests_total{route,status_code}` (answers given to
clients: worker answers relayed, and the router's own 429/502/503/504; the error-rate alert's
source), `deepinfer_router:rejected_requests_total{reason}` (overloaded, no_replica,
unreachable), `deepinfer_router:disagg_fallbacks_total` (prefill step failed, the decode worker
recomputed), `deepinfer_router:requests_in_flight`,
`deepinfer_router:discovery_failures_total{service}` (DNS resolutions that failed or answered
nothing; the pool kept its last known replicas).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

REJECT_REASONS = ("overloaded", "no_replica", "unreachable")
LATENCY_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0]


class _StateCollector:
    """Gauges read from the replica list and the edge counter at scrape time."""

    def __init__(self, replicas: Callable[[], Sequence], in_flight: Callable[[], int]) -> None:
        self._replicas = replicas
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("deepinfer_router:backend_healthy",
                                    "1 while the replica is admitted, 0 while ejected",
                                    labels=["backend", "role"])
        outstanding = GaugeMetricFamily("deepinfer_router:backend_outstanding_requests",
                                        "requests the router has in flight on the replica",
                                        labels=["backend", "role"])
        for replica in self._replicas():
            healthy.add_metric([replica.url, replica.role],
                               float(replica.healthy and not replica.draining))
            outstanding.add_metric([replica.url, replica.role], float(replica.outstanding))
        in_flight = GaugeMetricFamily("deepinfer_router:requests_in_flight",
                                      "client requests the router is serving")
        in_flight.add_metric([], float(self._in_flight()))
        yield from (healthy, outstanding, in_flight)


class RouterMetrics:
    """Counters and histograms the proxy records; `render()` is the /metrics body."""

    def __init__(self, replicas: Callable[[], Sequence], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("deepinfer_router:requests", "answers received from workers",
                                ["backend", "status_code"], registry=reg)
        self.duration = Histogram("deepinfer_router:request_duration_seconds",
                                  "from sending to a worker to the last byte relayed",
                                  ["backend"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.first_byte = Histogram("deepinfer_router:time_to_first_byte_seconds",
                                    "from sending to a worker to its answer's header",
                                    ["backend"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.retries = Counter("deepinfer_router:retries",
                               "requests moved elsewhere after a failed connection",
                               ["backend"], registry=reg)
        self.ejections = Counter("deepinfer_router:ejections",
                                 "healthy -> ejected transitions", ["backend"], registry=reg)
        self.client_requests = Counter("deepinfer_router:client_requests",
                                       "answers given to clients, by route and status code",
                                       ["route", "status_code"], registry=reg)
        self.rejected = Counter("deepinfer_router:rejected_requests",
                                "client requests refused by the router", ["reason"],
                                registry=reg)
        for reason in REJECT_REASONS:  # exported at 0 from the start, so rates and alerts see 0
            self.rejected.labels(reason)
        self.encoder_steps = Counter("deepinfer_router:encoder_steps",
                                     "image requests sent to an encoder worker first, by "
                                     "outcome (ok, failed: the next worker encodes itself)",
                                     ["outcome"], registry=reg)
        self.disagg_fallbacks = Counter("deepinfer_router:disagg_fallbacks",
                                        "prefill steps that failed (decode recomputed)",
                                        registry=reg)
        self.discovery_failures = Counter("deepinfer_router:discovery_failures",
                                          "DNS resolutions of a pool that failed",
                                          ["service"], registry=reg)
        reg.register(_StateCollector(replicas, in_flight))
        self._status_codes: dict[str, set[str]] = {}  # per backend, for forget_backend

    def count_answer(self, backend: str, status_code: int) -> None:
        """One answer with `status_code` received from `backend`."""
        self._status_codes.setdefault(backend, set()).add(str(status_code))
        self.requests.labels(backend, str(status_code)).inc()

    def forget_backend(self, backend: str) -> None:
        """Drop every series labelled with `backend` (a replica gone from its pool)."""
        for status_code in self._status_codes.pop(backend, ()):
            self.requests.remove(backend, status_code)
        for metric in (self.duration, self.first_byte, self.retries, self.ejections):
            metric.remove(backend)

    def render(self) -> bytes:
        return generate_latest(self.registry)
