"""DNS discovery over real sockets: the router resolves a pool name through a fake resolver
whose answer the test changes; the "pods" are fake workers on 127.0.0.1, 127.0.0.2 and
127.0.0.3 (all loopback on Linux), each bound to its own address on one shared port, as pods of
one Deployment share their container port.

Discovery refreshes every 50 ms; health checks run far apart (only the start-up round and the
immediate check of each new address change replica state) unless a test says otherwise.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.router.app import build_app
from deepinfer.router.config import RouterConfig
from tests.processes import free_port
from tests.router.router_fakes import STORED, FakeWorker, ServerThread, wait_for

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4}
IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


class FakeDNS:
    """The router's resolver: `answers[host]` is a list of addresses or an exception."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        answer = self.answers[host]
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)


@pytest.fixture(scope="module")
def pods():
    port = free_port()
    pool = [FakeWorker(f"pod{i}", host=ip, port=port).start() for i, ip in enumerate(IPS)]
    yield pool
    for pod in pool:
        pod.stop()


class Router:
    def __init__(self, dns: FakeDNS, **config) -> None:
        config.setdefault("health_interval_s", 3600)
        config.setdefault("discovery_interval_s", 0.05)
        self.dns = dns
        self.app = build_app(RouterConfig(discovery="dns", **config), resolve=dns)
        self.thread = ServerThread(self.app).start()
        self.client = httpx.Client(base_url=self.thread.url, timeout=30)

    @property
    def registry(self):
        return self.app.state.registry

    def healthy(self) -> set[str]:
        return {r.url for r in self.registry.all if r.healthy}

    def chat(self, **body) -> str:
        """The name of the pod that answered a chat request."""
        reply = self.client.post("/v1/chat/completions", json={**CHAT, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()["worker"]

    def series(self, name: str) -> dict[str, float]:
        text = self.client.get("/metrics").text
        return {s.labels.get("backend") or s.labels.get("service"): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name}

    def refreshes(self, count: int) -> None:
        """Wait until the router has resolved `count` more times."""
        target = self.dns.calls + count
        assert wait_for(lambda: self.dns.calls >= target)

    def close(self) -> None:
        self.client.close()
        self.thread.stop()


@pytest.fixture
def make_router(pods):
    for pod in pods:
        pod.reset()
    made: list[Router] = []

    def make(answers: dict[str, object], **config) -> Router:
        dns = FakeDNS()
        dns.answers.update(answers)
        config.setdefault("backends", (f"http://pool.test:{pods[0].thread.port}",))
        made.append(Router(dns, **config))
        return made[-1]

    yield make
    for router in made:
        router.close()


def test_scale_up_a_new_address_takes_traffic_after_its_health_check(pods, make_router):
    pods[1].healthy = False  # the new pod is still loading its model
    router = make_router({"pool.test": IPS[:1]}, policy="round_robin", health_interval_s=0.1)
    assert router.healthy() == {pods[0].url}
    assert {router.chat() for _ in range(3)} == {"pod0"}
    router.dns.answers["pool.test"] = IPS[:2]
    assert wait_for(lambda: len(router.registry.all) == 2)
    router.refreshes(2)
    assert router.healthy() == {pods[0].url} and pods[1].bodies == []  # joins ejected
    assert {router.chat() for _ in range(3)} == {"pod0"}
    pods[1].healthy = True
    assert wait_for(lambda: router.healthy() == {pods[0].url, pods[1].url})
    assert sorted(router.chat() for _ in range(4)) == ["pod0", "pod0", "pod1", "pod1"]
    assert router.client.get("/health").json()["healthy_replicas"] == 2


def test_scale_down_finishes_the_streams_in_flight(pods, make_router):
    router = make_router({"pool.test": IPS[1:2]})
    leaving = router.registry.all[0]
    pods[1].mode, pods[1].slow_events = "slow", 150  # a ~3 s stream
    with router.client.stream("POST", "/v1/chat/completions",
                              json={**CHAT, "stream": True}) as reply:
        lines = reply.iter_lines()
        assert '"pod1"' in next(lines)
        router.dns.answers["pool.test"] = IPS[:1]  # pod1 scaled down, pod0 up
        assert wait_for(lambda: router.healthy() == {pods[0].url})
        assert router.registry.draining == [leaving] and leaving.outstanding == 1
        assert {router.chat() for _ in range(3)} == {"pod0"}  # no new request for pod1
        assert router.series("deepinfer_router:backend_outstanding_requests")[
            pods[1].url] == 1
        assert router.series("deepinfer_router:backend_healthy")[pods[1].url] == 0
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and len(events) == 150  # 149 more + [DONE]
    assert pods[1].completed == 1 and pods[1].aborted == 0
    assert wait_for(lambda: router.registry.draining == [])
    assert router.registry.known() == router.registry.all  # forgotten
    assert pods[1].url not in router.series("deepinfer_router:requests_total")
    assert pods[1].url not in router.series("deepinfer_router:backend_healthy")
    assert wait_for(lambda: router.app.state.proxy.in_flight == 0)


def test_a_resolver_error_keeps_the_pool(pods, make_router):
    router = make_router({"pool.test": IPS[:2]})
    assert router.healthy() == {pods[0].url, pods[1].url}
    router.dns.answers["pool.test"] = socket.gaierror(socket.EAI_NONAME, "NXDOMAIN")
    router.refreshes(3)
    assert router.healthy() == {pods[0].url, pods[1].url}
    assert {router.chat() for _ in range(4)} == {"pod0", "pod1"}
    assert router.series("deepinfer_router:discovery_failures_total")[
        f"http://pool.test:{pods[0].thread.port}"] >= 3


def test_an_empty_pool_answers_503(pods, make_router):
    never = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    router = make_router({"pool.test": never})  # never resolved: nothing known
    reply = router.client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_healthy_replica"
    assert router.client.get("/health").status_code == 503
    router.dns.answers["pool.test"] = IPS[:1]
    assert wait_for(lambda: router.healthy() == {pods[0].url})
    assert router.chat() == "pod0"


def test_prefix_affinity_over_discovered_replicas(pods, make_router):
    router = make_router({"pool.test": IPS}, policy="prefix_affinity")
    assert len(router.healthy()) == 3

    def conversation(i: int) -> str:
        """Three turns of conversation i; the one pod that answered them all."""
        messages = [{"role": "user", "content": f"conversation {i}"}]
        answered = set()
        for turn in range(3):
            answered.add(router.chat(messages=messages))
            messages = messages + [{"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": f"turn {turn}"}]
        assert len(answered) == 1
        return answered.pop()

    placed = {i: conversation(i) for i in range(12)}
    assert len(set(placed.values())) > 1
    router.dns.answers["pool.test"] = IPS[:2]  # pod2 leaves: only its conversations move
    assert wait_for(lambda: len(router.registry.all) == 2)
    for i, pod in placed.items():
        if pod != "pod2":
            assert conversation(i) == pod


def test_disaggregated_pools_by_dns(pods, make_router):
    port = pods[0].thread.port
    router = make_router({"prefill.test": IPS[:1], "decode.test": IPS[1:3]}, backends=(),
                         prefill=(f"http://prefill.test:{port}",),
                         decode=(f"http://decode.test:{port}",))
    assert [r.role for r in router.registry.all] == ["prefill", "decode", "decode"]
    reply = router.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["worker"] in ("pod1", "pod2")
    assert pods[0].bodies[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert reply.json()["echo"]["kv_transfer_params"] == {**STORED, "prompt_cached_tokens": 3}


def test_real_dns_localhost_pool(pods, make_router):
    """The default resolver: `localhost` names pod0 (and ::1, where nothing listens)."""
    port = pods[0].thread.port
    app = build_app(RouterConfig(backends=(f"http://localhost:{port}",), discovery="dns",
                                 health_interval_s=3600))
    thread = ServerThread(app).start()
    try:
        reply = httpx.post(thread.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert reply.status_code == 200 and reply.json()["worker"] == "pod0"
        assert pods[0].url in {r.url for r in app.state.registry.all if r.healthy}
        assert json.loads(httpx.get(thread.url + "/health").text)["status"] == "ok"
    finally:
        thread.stop()
