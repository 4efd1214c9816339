"""DNS discovery without sockets: `Registry.sync` / `release`, `ServiceDiscovery` over a fake
resolver, URL handling, config validation, and one real lookup of `localhost`."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.router.cli import build_parser, config_from_args, main
from deepinfer.router.config import RouterConfig
from deepinfer.router.discovery import Service, ServiceDiscovery, resolve_dns
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.registry import Registry, Replica

POOL = "http://pool:8000"


class FakeDNS:
    """Answers per host: a list of addresses, an exception to raise, or "hang"."""

    def __init__(self, **answers) -> None:
        self.answers = answers
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        answer = self.answers[host]
        if answer == "hang":
            await asyncio.sleep(3600)
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)


def urls(replicas) -> list[str]:
    return [r.url for r in replicas]


def test_sync_adds_ejected_and_removes_idle_replicas():
    forgotten: list[str] = []
    registry = Registry([Replica("http://static:1")], on_forget=lambda r: forgotten.append(r.url))
    added = registry.sync(POOL, "decode", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    assert urls(added) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert all(not r.healthy and r.role == "decode" and r.source == POOL for r in added)
    assert registry.sync(POOL, "decode", ["http://10.0.0.2:8000"]) == []
    assert urls(registry.all) == ["http://static:1", "http://10.0.0.2:8000"]
    assert forgotten == ["http://10.0.0.1:8000"] and registry.draining == []


def test_a_removed_replica_drains_its_requests_then_is_forgotten():
    forgotten: list[str] = []
    registry = Registry([], on_forget=lambda r: forgotten.append(r.url))
    busy, idle = registry.sync(POOL, "both", ["http://a:1", "http://b:1"])
    busy.healthy = idle.healthy = True
    busy.outstanding = 2
    registry.sync(POOL, "both", ["http://b:1"])
    assert registry.replicas("both") == [idle]  # out of selection at once
    assert registry.draining == [busy] and busy.draining and busy.healthy
    assert registry.known() == [idle, busy] and forgotten == []
    registry.release(busy)
    assert forgotten == [] and busy.outstanding == 1
    registry.release(busy)
    assert forgotten == ["http://a:1"] and registry.known() == [idle]


def test_an_address_back_before_draining_ends_is_the_same_replica():
    registry = Registry([])
    (replica,) = registry.sync(POOL, "both", ["http://a:1"])
    replica.outstanding = 1
    registry.sync(POOL, "both", [])
    assert registry.all == [] and registry.draining == [replica]
    assert registry.sync(POOL, "both", ["http://a:1"]) == [replica]
    assert registry.all == [replica] and not replica.draining and registry.draining == []
    registry.release(replica)
    assert registry.all == [replica]  # not forgotten: it is back in the pool


def test_an_address_another_source_holds_is_skipped():
    registry = Registry([Replica("http://10.0.0.1:8000")])
    assert registry.sync(POOL, "both", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]) \
        == [registry.all[1]]
    assert urls(registry.all) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    registry.sync(POOL, "both", [])
    assert urls(registry.all) == ["http://10.0.0.1:8000"]  # the static one stays


def test_a_health_check_does_not_update_a_replica_removed_meanwhile():
    ejected: list[str] = []
    registry = Registry([], on_eject=lambda r: ejected.append(r.url))
    (replica,) = registry.sync(POOL, "both", ["http://a:1"])

    def answer(request: httpx.Request) -> httpx.Response:
        registry.sync(POOL, "both", [])  # the pod left while its check was in flight
        return httpx.Response(200)

    async def check() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await registry.check(client, replica, 1.0)
    asyncio.run(check())
    assert not replica.healthy and registry.all == [] and ejected == []


def test_forgetting_a_backend_drops_its_metric_series():
    registry = Registry([])
    metrics = RouterMetrics(registry.known, lambda: 0)
    registry.on_forget = lambda r: metrics.forget_backend(r.url)
    a, b = registry.sync(POOL, "both", ["http://a:1", "http://b:1"])
    for replica in (a, b):
        metrics.count_answer(replica.url, 200)
        metrics.duration.labels(replica.url).observe(0.1)
    metrics.count_answer(a.url, 503)
    metrics.retries.labels(a.url).inc()
    registry.sync(POOL, "both", ["http://b:1"])
    backends = {s.labels.get("backend")
                for f in text_string_to_metric_families(metrics.render().decode())
                for s in f.samples}
    assert "http://a:1" not in backends and "http://b:1" in backends


def test_service_urls():
    service = Service.from_url("http://deepinfer-decode-headless:8000/", "decode")
    assert (service.url, service.host, service.port, service.path) == \
        ("http://deepinfer-decode-headless:8000", "deepinfer-decode-headless", 8000, "")
    assert service.replica_url("10.1.2.3") == "http://10.1.2.3:8000"
    assert service.replica_url("fd00::7") == "http://[fd00::7]:8000"
    assert Service.from_url("https://pool", "both").replica_url("10.0.0.1") == \
        "https://10.0.0.1:443"
    assert Service.from_url("http://pool:9/api", "both").replica_url("::1") == \
        "http://[::1]:9/api"


def discovery(dns: FakeDNS, *, timeout_s: float = 1.0):
    registry = Registry([])
    failures: list[str] = []
    services = [Service.from_url("http://prefill-svc:8000", "prefill"),
                Service.from_url("http://decode-svc:8000", "decode")]
    return (ServiceDiscovery(registry, services, resolve=dns, timeout_s=timeout_s,
                             on_failure=failures.append), registry, failures)


def test_refresh_follows_each_pool_with_its_role():
    dns = FakeDNS(**{"prefill-svc": ["10.0.0.1"], "decode-svc": ["10.0.1.1", "10.0.1.2"]})
    disco, registry, failures = discovery(dns)
    assert len(asyncio.run(disco.refresh())) == 3
    assert urls(registry.replicas("prefill")) == ["http://10.0.0.1:8000"]
    assert urls(registry.replicas("decode")) == ["http://10.0.1.1:8000", "http://10.0.1.2:8000"]
    dns.answers["decode-svc"] = ["10.0.1.2", "10.0.1.3"]  # one pod replaced
    assert urls(asyncio.run(disco.refresh())) == ["http://10.0.1.3:8000"]
    assert urls(registry.replicas("decode")) == ["http://10.0.1.2:8000", "http://10.0.1.3:8000"]
    assert failures == []


@pytest.mark.parametrize("bad_answer", [
    socket.gaierror(socket.EAI_NONAME, "Name or service not known"),  # NXDOMAIN
    [],                                                                # answered no address
    "hang",                                                            # timeout
    RuntimeError("a resolver bug"),
])
def test_a_failed_resolution_keeps_the_pool(bad_answer):
    dns = FakeDNS(**{"prefill-svc": ["10.0.0.1"], "decode-svc": ["10.0.1.1"]})
    disco, registry, failures = discovery(dns, timeout_s=0.05)
    asyncio.run(disco.refresh())
    dns.answers["decode-svc"] = bad_answer
    for _ in range(2):
        assert asyncio.run(disco.refresh()) == []
    assert urls(registry.all) == ["http://10.0.0.1:8000", "http://10.0.1.1:8000"]
    assert failures == ["http://decode-svc:8000"] * 2
    dns.answers["decode-svc"] = ["10.0.1.9"]  # resolves again: follows the new answer
    asyncio.run(disco.refresh())
    assert urls(registry.replicas("decode")) == ["http://10.0.1.9:8000"]


def test_real_dns_resolves_localhost():
    addresses = asyncio.run(resolve_dns("localhost", 8000))
    assert addresses and set(addresses) <= {"127.0.0.1", "::1"}
    assert len(addresses) == len(set(addresses))


def test_dns_flags_become_the_config():
    args = build_parser().parse_args([
        "--discovery", "dns", "--discovery-interval-s", "2", "--prefill",
        "http://deepinfer-prefill-headless:8000", "--decode",
        "http://deepinfer-decode-headless:8000"])
    config = config_from_args(args)
    assert (config.discovery, config.discovery_interval_s) == ("dns", 2.0)
    assert config.disaggregated and RouterConfig(backends=("http://a",)).discovery == "static"


@pytest.mark.parametrize("argv, message", [
    (["--backend", "http://a", "--discovery-interval-s", "0"],
     "discovery_interval_s=0.0 must be > 0"),
    (["--backend", "http://:8000", "--discovery", "dns"], "has no host"),
    (["--backend", "http://pool:http", "--discovery", "dns"], "invalid port"),
    (["--backend", "http://pool:8000/?x=1", "--discovery", "dns"], "query"),
])
def test_bad_discovery_flags_exit_2_with_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_discovery_mode():
    with pytest.raises(ValueError, match="discovery='consul' is unknown; use static"):
        RouterConfig(backends=("http://a",), discovery="consul")
