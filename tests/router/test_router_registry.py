"""Registry health checks: ejection after failures, at once when unreachable, re-admission.

The workers are an httpx.MockTransport: no sockets, no clock."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deepinfer.router.registry import Registry, Replica

A, B = "http://a:8000", "http://b:8000"


class Workers:
    """Answers GET /health per host: an int status, or an exception class to raise."""

    def __init__(self) -> None:
        self.answer: dict[str, object] = {"a": 200, "b": 200}
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._handle))

    def _handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        answer = self.answer[request.url.host]
        if isinstance(answer, type):
            raise answer("simulated", request=request)
        return httpx.Response(answer)


def check(registry: Registry, workers: Workers) -> None:
    asyncio.run(registry.check_all(workers.client, 1.0))


@pytest.fixture
def setup():
    ejected: list[str] = []
    registry = Registry([Replica(A), Replica(B)], max_failures=3,
                        on_eject=lambda r: ejected.append(r.url))
    return registry, Workers(), ejected


def test_replicas_start_ejected_and_join_at_their_first_good_check(setup):
    registry, workers, ejected = setup
    assert [r.healthy for r in registry.all] == [False, False]
    workers.answer["b"] = 503
    check(registry, workers)
    assert [r.healthy for r in registry.all] == [True, False]
    assert ejected == []  # never admitted, so never ejected


def test_ejected_after_max_failures_then_readmitted(setup):
    registry, workers, ejected = setup
    a = registry.all[0]
    check(registry, workers)
    workers.answer["a"] = 503
    for expected_failures in (1, 2):
        check(registry, workers)
        assert a.healthy and a.consecutive_failures == expected_failures
    check(registry, workers)
    assert not a.healthy and ejected == [A]   # on_eject ran once
    check(registry, workers)  # still failing: ejected once, not again
    assert ejected == [A]
    workers.answer["a"] = 200
    check(registry, workers)
    assert a.healthy and a.consecutive_failures == 0 and registry.all[1].healthy


def test_a_success_resets_the_failure_count(setup):
    registry, workers, ejected = setup
    check(registry, workers)
    for answer in (503, 503, 200, 503, 503):
        workers.answer["a"] = answer
        check(registry, workers)
    assert registry.all[0].healthy and ejected == []


def test_a_refused_connection_ejects_at_once(setup):
    registry, workers, ejected = setup
    check(registry, workers)
    workers.answer["b"] = httpx.ConnectError
    check(registry, workers)
    assert not registry.all[1].healthy and ejected == [B]


def test_a_timeout_counts_as_one_failure(setup):
    registry, workers, ejected = setup
    check(registry, workers)
    workers.answer["a"] = httpx.ReadTimeout
    check(registry, workers)
    assert registry.all[0].healthy and registry.all[0].consecutive_failures == 1


def test_request_path_failures_use_the_same_rules(setup):
    registry, workers, ejected = setup
    check(registry, workers)
    a = registry.all[0]
    registry.record_failure(a, unreachable=False, reason="reset")
    assert a.healthy
    registry.record_failure(a, unreachable=True, reason="refused")
    assert not a.healthy and ejected == [A]


def test_roles():
    registry = Registry([Replica("http://p", "prefill"), Replica("http://d", "decode"),
                         Replica("http://x", "both")])
    assert [r.url for r in registry.replicas("prefill")] == ["http://p", "http://x"]
    assert [r.url for r in registry.replicas("decode")] == ["http://d", "http://x"]
    assert [r.url for r in registry.serving()] == ["http://d", "http://x"]
    with pytest.raises(ValueError, match="role 'encoder'"):
        Registry([Replica("http://e", "encoder")])
