"""The router's proxy over real sockets: the router app and fake workers run in uvicorn threads.

Health checks are set far apart (`health_interval_s=3600`) so that only the start-up round and
the requests themselves change replica state; tests that need a replica admitted while it
cannot answer set `healthy` directly.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.router.app import build_app
from deepinfer.router.config import RouterConfig
from tests.processes import free_port, metric
from tests.router.router_fakes import STORED, FakeWorker, HangUpServer, ServerThread, wait_for

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4}


@pytest.fixture(scope="module")
def workers():
    pool = [FakeWorker("w0", ("fake-model",)).start(),
            FakeWorker("w1", ("fake-model", "other-model")).start()]
    yield pool
    for worker in pool:
        worker.stop()


class Router:
    def __init__(self, **config) -> None:
        config.setdefault("health_interval_s", 3600)
        self.app = build_app(RouterConfig(**config))
        self.thread = ServerThread(self.app).start()
        self.url = self.thread.url
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def replicas(self):
        return self.app.state.registry.all

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.url, name, **labels)

    def close(self) -> None:
        self.client.close()
        self.thread.stop()


@pytest.fixture
def router_factory(workers):
    for worker in workers:
        worker.reset()
    made: list[Router] = []

    def make(**config) -> Router:
        config.setdefault("backends", tuple(w.url for w in workers))
        made.append(Router(**config))
        return made[-1]

    yield make
    for router in made:
        router.close()


def test_json_and_sse_pass_through_unchanged(workers, router_factory):
    router = router_factory(policy="round_robin")
    raw = json.dumps(CHAT, indent=1).encode()  # odd formatting must reach the worker as is
    reply = router.client.post("/v1/chat/completions", content=raw,
                               headers={"content-type": "application/json"})
    direct = httpx.post(workers[1].url + "/v1/chat/completions", content=raw,
                        headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.content == direct.content.replace(b"w1", b"w0")
    assert workers[0].raw_bodies == [raw]

    body = {**CHAT, "stream": True}
    with router.client.stream("POST", "/v1/completions", json=body) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        relayed = b"".join(streamed.iter_raw())
    direct = httpx.post(workers[1].url + "/v1/completions", json=body).content
    assert relayed == direct and relayed.endswith(b"data: [DONE]\n\n")
    assert relayed.count(b"data: ") == 4


def test_worker_4xx_reaches_the_client_unchanged(workers, router_factory):
    router = router_factory()
    reply = router.client.post("/v1/chat/completions", json={**CHAT, "user": "bad"})
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "bad temperature", "type":
                                     "invalid_request_error", "param": "temperature",
                                     "code": "invalid_value"}
    assert router.metric("deepinfer_router:retries_total") == 0


def test_refused_connection_retries_on_another_replica(workers, router_factory):
    dead = f"http://127.0.0.1:{free_port()}"
    router = router_factory(backends=(dead, workers[0].url), policy="round_robin")
    router.replicas[0].healthy = True  # admitted, then its process died
    for _ in range(2):
        assert router.client.post("/v1/chat/completions", json=CHAT).json()["worker"] == "w0"
    assert not router.replicas[0].healthy  # ejected at the first refused connection
    assert router.metric("deepinfer_router:retries_total", backend=dead) == 1
    assert router.metric("deepinfer_router:ejections_total", backend=dead) == 1
    assert router.metric("deepinfer_router:backend_healthy", backend=dead) == 0
    assert len(workers[0].bodies) == 2


def test_hang_up_before_the_answer_retries_on_another_replica(workers, router_factory):
    hang_up = HangUpServer()
    try:
        router = router_factory(backends=(hang_up.url, workers[1].url), policy="round_robin")
        router.replicas[0].healthy = True
        with router.client.stream("POST", "/v1/chat/completions",
                                  json={**CHAT, "stream": True}) as reply:
            events = [line for line in reply.iter_lines() if line]
        assert hang_up.posts == 1 and events[-1] == "data: [DONE]"
        assert all('"worker": "w1"' in e for e in events[:-1])
        assert router.metric("deepinfer_router:retries_total", backend=hang_up.url) == 1
    finally:
        hang_up.close()


def test_every_replica_refusing_is_an_openai_503(router_factory):
    dead = tuple(f"http://127.0.0.1:{free_port()}" for _ in range(2))
    router = router_factory(backends=dead)
    for replica in router.replicas:
        replica.healthy = True
    reply = router.client.post("/v1/completions", json={"prompt": "x"})
    assert reply.status_code == 503
    assert reply.json()["error"]["message"].startswith("No worker could be reached (tried ")
    assert not any(r.healthy for r in router.replicas)
    assert router.metric("deepinfer_router:rejected_requests_total", reason="unreachable") == 1
    assert router.metric("deepinfer_router:retries_total") == 2


def test_no_retry_once_the_worker_began_answering(workers, router_factory):
    router = router_factory(policy="round_robin")
    workers[0].mode = workers[1].mode = "break"
    with router.client.stream("POST", "/v1/chat/completions",
                              json={**CHAT, "stream": True}) as reply:
        lines = [line for line in reply.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["worker"] == "w0"
    assert events[-1]["error"]["code"] == "worker_failed"   # the answer is cut: said so,
    assert lines[-1] == "data: [DONE]"                      # then the stream ends as usual
    cut = router.client.post("/v1/chat/completions", json=CHAT)  # a JSON answer cut short
    assert cut.status_code == 502 and cut.json()["error"]["code"] == "worker_failed"
    assert len(workers[0].bodies) == len(workers[1].bodies) == 1  # never re-sent
    assert router.metric("deepinfer_router:retries_total") == 0
    assert wait_for(lambda: router.app.state.proxy.in_flight == 0)
    assert [r.outstanding for r in router.replicas] == [0, 0]


def test_client_disconnect_mid_stream_aborts_the_worker(workers, router_factory):
    router = router_factory(backends=(workers[0].url,))
    workers[0].mode = "slow"
    with router.client.stream("POST", "/v1/chat/completions",
                              json={**CHAT, "stream": True}) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: {")
        assert router.metric("deepinfer_router:backend_outstanding_requests") == 1
    assert wait_for(lambda: workers[0].aborted == 1)
    assert workers[0].completed == 0
    assert wait_for(lambda: router.replicas[0].outstanding == 0
                    and router.app.state.proxy.in_flight == 0)


def test_client_disconnect_before_the_answer_aborts_the_worker(workers, router_factory):
    router = router_factory(backends=(workers[0].url,))
    workers[0].mode = "slow"
    with pytest.raises(httpx.ReadTimeout):
        router.client.post("/v1/chat/completions", json=CHAT, timeout=0.3)
    assert wait_for(lambda: workers[0].aborted == 1)
    assert wait_for(lambda: router.replicas[0].outstanding == 0
                    and router.app.state.proxy.in_flight == 0)


def test_edge_cap_answers_429_when_overloaded(workers, router_factory):
    router = router_factory(max_concurrent_requests=1)
    workers[0].mode = workers[1].mode = "slow"
    with router.client.stream("POST", "/v1/chat/completions",
                              json={**CHAT, "stream": True}) as reply:
        lines = reply.iter_lines()  # held: a dropped iterator would close the stream
        assert next(lines).startswith("data: {")
        refused = router.client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
    workers[0].mode = workers[1].mode = "ok"
    assert wait_for(lambda: router.app.state.proxy.in_flight == 0)
    assert router.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert router.metric("deepinfer_router:rejected_requests_total", reason="overloaded") == 1
    answers = {code: router.metric("deepinfer_router:client_requests_total",
                                   route="/v1/chat/completions", status_code=code)
               for code in ("200", "429")}
    assert answers == {"200": 2, "429": 1}   # the held stream, the refusal, the last request


def test_no_healthy_replica_is_an_openai_503(workers, router_factory):
    workers[0].healthy = workers[1].healthy = False
    router = router_factory()
    reply = router.client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "no_healthy_replica" and "No healthy worker" in error["message"]
    assert router.client.get("/health").status_code == 503
    assert router.client.get("/liveness").status_code == 200   # not restarted for its workers
    assert router.client.get("/v1/models").status_code == 503


@pytest.mark.parametrize("body, code, message", [
    (b"", "invalid_json", "The request has no body"),
    (b'{"model": ', "invalid_json", "not valid JSON (Expecting value: line 1 column 11"),
    (b"[1, 2]", "invalid_type", "is JSON array; send a JSON object"),
    (b'"hi"', "invalid_type", "is JSON string"),
    (b"3.5", "invalid_type", "is JSON number"),
    (b"null", "invalid_type", "is JSON null"),
    (b"true", "invalid_type", "is JSON boolean"),
    (b"[" * 129 + b"]" * 129, "invalid_type", "is JSON array"),   # deeper than MAX_JSON_DEPTH
])
def test_bodies_no_worker_could_accept_are_400_even_without_workers(workers, router_factory,
                                                                    body, code, message):
    """The same codes as a worker's answer to these bodies (tests/server/test_server_app.py)."""
    workers[0].healthy = workers[1].healthy = False
    router = router_factory()
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = router.client.post(path, content=body,
                                   headers={"content-type": "application/json"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", code)
        assert message in error["message"]
    assert workers[0].raw_bodies == workers[1].raw_bodies == []
    assert router.metric("deepinfer_router:client_requests_total",
                         route="/v1/completions", status_code="400") == 1


def test_models_are_aggregated_by_id(workers, router_factory):
    router = router_factory()
    assert router.client.get("/health").json() == {"status": "ok", "healthy_replicas": 2}
    data = router.client.get("/v1/models").json()
    assert data["object"] == "list"
    assert sorted(card["id"] for card in data["data"]) == ["fake-model", "other-model"]
    assert router.client.get("/v1/models/other-model").json()["owned_by"] == "w1"
    missing = router.client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert router.client.get("/v2/nothing").json()["error"]["type"] == "invalid_request_error"


def test_prefix_affinity_keeps_a_conversation_on_one_replica(workers, router_factory):
    router = router_factory(policy="prefix_affinity")
    for conversation in range(6):
        messages = [{"role": "user", "content": f"conversation {conversation}"}]
        for turn in range(3):
            router.client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
            messages = messages + [{"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": f"turn {turn}"}]
    by_conversation: dict[str, set[str]] = {}
    for worker in workers:
        for body in worker.bodies:
            by_conversation.setdefault(body["messages"][0]["content"], set()).add(worker.name)
    assert len(by_conversation) == 6
    assert all(len(names) == 1 for names in by_conversation.values())


def test_metrics_names(workers, router_factory):
    router = router_factory()
    router.client.post("/v1/chat/completions", json=CHAT)
    text = router.client.get("/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"deepinfer_router:requests_total", "deepinfer_router:request_duration_seconds_count",
            "deepinfer_router:time_to_first_byte_seconds_count",
            "deepinfer_router:backend_healthy",
            "deepinfer_router:backend_outstanding_requests",
            "deepinfer_router:requests_in_flight"} <= names
    assert router.metric("deepinfer_router:requests_total", status_code="200") == 1


def test_disaggregated_prefill_then_decode(workers, router_factory):
    prefill, decode = workers
    router = router_factory(backends=(), prefill=(prefill.url,), decode=(decode.url,))
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 2,
            "max_completion_tokens": 9, "min_tokens": 3}
    with router.client.stream("POST", "/v1/chat/completions", json=body) as reply:
        events = [line for line in reply.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"worker": "w1"' in events[0]
    sent_to_prefill = prefill.bodies[0]
    assert sent_to_prefill == {**CHAT, "kv_transfer_params": {"do_remote_decode": True},
                               "max_tokens": 1, "stream": False, "n": 1}
    # what the client's prompt hit at the prefill goes along, for the decode's usage
    assert decode.bodies[0] == {**body, "kv_transfer_params": {**STORED,
                                                               "prompt_cached_tokens": 3}}

    prefill.mode = "break"  # a failed prefill step: the decode worker recomputes
    reply = router.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["echo"] == {"prompt": "abc",
                                                                   "max_tokens": 2}
    assert router.metric("deepinfer_router:disagg_fallbacks_total") == 1
    router.replicas[0].healthy = False  # no prefill worker at all: the same fallback
    assert router.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert router.metric("deepinfer_router:disagg_fallbacks_total") == 2
    assert len(prefill.bodies) == 2 and "kv_transfer_params" not in decode.bodies[-1]
    assert router.client.get("/health").json()["healthy_replicas"] == 1
    router.replicas[0].healthy = True   # an invalid request: the same 4xx, not a fallback
    reply = router.client.post("/v1/completions", json={"prompt": "x", "user": "bad"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "temperature"
    assert router.metric("deepinfer_router:disagg_fallbacks_total") == 2



def test_disaggregated_no_decode_worker_skips_the_prefill(workers, router_factory):
    prefill, decode = workers
    decode.healthy = False  # ejected at the start-up check
    router = router_factory(backends=(), prefill=(prefill.url,), decode=(decode.url,))
    reply = router.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "no_healthy_replica"
    assert prefill.bodies == []  # no prefill spent on a request that cannot be decoded
    assert router.metric("deepinfer_router:rejected_requests_total", reason="no_replica") == 1


@pytest.mark.parametrize("depth", [100_000, 900, 129])
def test_json_nested_deeper_than_the_router_parses_is_refused(workers, router_factory, depth):
    """Issue 26.7: a body nested deeper than MAX_JSON_DEPTH used to be forwarded unparsed, so a
    client's own `kv_transfer_params` reached the decode worker; it is now a 400 from the
    router (json.loads' RecursionError included: never a 500), and no worker sees it."""
    nested = b"[" * depth + b"]" * depth
    prefill, decode = workers
    for config in ({}, {"backends": (), "prefill": (prefill.url,), "decode": (decode.url,)}):
        router = router_factory(policy="prefix_affinity", **config)
        for path, body in (("/v1/completions", b'{"prompt": "hi", "x":' + nested
                            + b', "kv_transfer_params": {"do_remote_prefill": true}}'),
                           ("/v1/chat/completions", b'{"messages":[{"role":"user","x":'
                            + nested + b'}]}')):
            reply = router.client.post(path, content=body,
                                       headers={"content-type": "application/json"})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "invalid_json" and "deeper than 128 levels" in \
                error["message"]
    assert prefill.raw_bodies == decode.raw_bodies == []


def test_a_4300_digit_integer_is_a_400_without_pythons_advice(workers, router_factory):
    router = router_factory()
    reply = router.client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": '
                               + b"9" * 5000 + b"}", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "more than 4,300 digits" in message
    assert "sys." not in message and "set_int_max_str_digits" not in message


def test_head_answers_on_the_get_routes(workers, router_factory):
    router = router_factory()
    for path in ("/health", "/liveness", "/metrics", "/v1/models", "/v1/models/fake-model"):
        reply = router.client.head(path)
        assert reply.status_code == 200, (path, reply.status_code)
        assert reply.content == b""


def test_the_routers_own_api_key_guards_v1_and_the_docs(workers):
    app = build_app(RouterConfig(backends=tuple(w.url for w in workers),
                                 health_interval_s=3600), api_keys=("sekrit", "other"))
    thread = ServerThread(app).start()
    try:
        for path in ("/v1/models", "/docs", "/redoc", "/openapi.json"):
            reply = httpx.get(thread.url + path, timeout=30)
            assert reply.status_code == 401, path
            assert reply.json()["error"]["code"] == "invalid_api_key"
            wrong = httpx.get(thread.url + path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and "a wrong API key" in wrong.text
        for key in ("sekrit", "other"):
            auth = {"Authorization": f"Bearer {key}"}
            assert httpx.get(thread.url + "/openapi.json", headers=auth).status_code == 200
            assert httpx.get(thread.url + "/v1/models", headers=auth).status_code == 200
        reply = httpx.post(thread.url + "/v1/chat/completions", json=CHAT)
        assert reply.status_code == 401
        assert workers[0].raw_bodies == workers[1].raw_bodies == []   # refused at the edge
        assert httpx.get(thread.url + "/health").status_code == 200   # probes stay open
    finally:
        thread.stop()


def test_models_relay_a_workers_401_not_503(workers, router_factory):
    for worker in workers:
        worker.mode = "auth"  # /v1/models needs "Authorization: Bearer key"
    router = router_factory()
    for path in ("/v1/models", "/v1/models/fake-model"):
        reply = router.client.get(path)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        assert router.client.get(path, headers={"Authorization": "Bearer key"}).status_code == 200
    workers[0].healthy = workers[1].healthy = False
    router = router_factory()  # nobody admitted: 503, whatever the model
    assert router.client.get("/v1/models/fake-model").status_code == 503


def test_disaggregated_hung_prefill_worker_falls_back_once_ejected(workers, router_factory):
    prefill, decode = workers
    prefill.mode = "slow"  # answers a JSON request only after ~10 s
    router = router_factory(backends=(), prefill=(prefill.url,), decode=(decode.url,))
    replica = router.replicas[0]
    threading.Timer(0.5, lambda: setattr(replica, "healthy", False)).start()  # ejected
    started = time.monotonic()
    reply = router.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["worker"] == "w1"
    assert time.monotonic() - started < 5  # not the prefill worker's whole hang
    assert "kv_transfer_params" not in decode.bodies[-1]
    assert router.metric("deepinfer_router:disagg_fallbacks_total") == 1
    assert wait_for(lambda: prefill.aborted == 1)  # its connection was closed
    assert replica.outstanding == 0


def test_a_worker_ejected_before_answering_hands_the_request_to_another(workers,
                                                                      router_factory):
    """A stopped worker (SIGSTOP) held its requests until --request-timeout-s even after the
    health checks ejected it (found by black-box testing); now the waiting request moves."""
    stuck, other = workers
    stuck.mode = "slow"  # answers a JSON request only after ~10 s
    router = router_factory(policy="round_robin")   # the first request goes to w0
    replica = next(r for r in router.replicas if r.url == stuck.url)
    threading.Timer(0.5, lambda: setattr(replica, "healthy", False)).start()  # ejected
    started = time.monotonic()
    reply = router.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["worker"] == "w1"
    assert time.monotonic() - started < 5
    assert wait_for(lambda: stuck.aborted == 1)   # its connection was closed
    assert router.metric("deepinfer_router:retries_total", backend=stuck.url) == 1
    assert wait_for(lambda: replica.outstanding == 0 and router.app.state.proxy.in_flight == 0)
    assert len(other.bodies) == 1


def test_client_disconnect_during_the_prefill_step_aborts_the_prefill(workers, router_factory):
    prefill, decode = workers
    prefill.mode = "slow"
    router = router_factory(backends=(), prefill=(prefill.url,), decode=(decode.url,))
    with pytest.raises(httpx.ReadTimeout):
        router.client.post("/v1/chat/completions", json=CHAT, timeout=0.6)
    assert wait_for(lambda: prefill.aborted == 1)
    assert wait_for(lambda: router.replicas[0].outstanding == 0
                    and router.app.state.proxy.in_flight == 0)
    assert decode.bodies == []
