"""The HTTP layer over a scripted engine: routes, bodies, SSE framing, fan-out, status codes."""

import gzip
import json

import pytest
from fastapi.testclient import TestClient

from deepinfer.server.app import build_app
from server_doubles import BOS, CharTokenizer, ScriptedEngine

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def client(engine):
    return TestClient(build_app(engine), raise_server_exceptions=False)


def sse_payloads(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def assert_error(response, status, param=None, code=None, text=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert text in error["message"], error["message"]
    return error


def test_models_health_and_metrics(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert (card["id"], card["object"], card["max_model_len"], card["owned_by"]) == (
        "test-model", "model", 64, "deepinfer")
    assert client.get("/v1/models/test-model").json()["id"] == "test-model"
    assert_error(client.get("/v1/models/other"), 404, "model", "model_not_found")
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'deepinfer:kv_cache_usage_perc{model_name="test-model"} 0.25' in metrics.text
    for path in ("/health", "/metrics", "/v1/models", "/v1/models/test-model"):   # HEAD as GET
        head = client.head(path)
        assert head.status_code == 200 and head.content == b""
    engine.dead = True
    assert_error(client.get("/health"), 503, None, "engine_dead", "step loop raised")


def test_chat_non_stream(client, engine):
    body = client.post("/v1/chat/completions", json={
        "model": "test-model", "messages": USER, "temperature": 0}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world", "refusal": None,
                                 "tool_calls": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt_ids = CharTokenizer().encode(
        "<s>user: hi\nassistant: ", add_special_tokens=False)
    (request_id, (sent_ids, params)), = engine.requests.items()
    assert sent_ids == prompt_ids and sent_ids.count(BOS) == 1
    assert request_id == body["id"] + "-0"
    assert params.temperature == 0 and params.max_tokens == 64 - len(prompt_ids)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 11,
                             "total_tokens": len(prompt_ids) + 11,
                             "prompt_tokens_details": {"cached_tokens": 2}}


def test_chat_max_tokens_and_logprobs(client):
    body = client.post("/v1/chat/completions", json={
        "messages": USER, "max_completion_tokens": 5, "logprobs": True,
        "top_logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hello" and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == list("Hello")
    assert content[0] == {"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": [
        {"token": "H", "logprob": -0.5, "bytes": [72]},
        {"token": "x", "logprob": -1.5, "bytes": [120]}]}


def test_chat_stream_framing_and_usage(client):
    response = client.post("/v1/chat/completions", json={
        "messages": USER, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_payloads(response)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 11
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_stream_without_usage_has_no_usage_key(client):
    chunks = sse_payloads(client.post("/v1/chat/completions",
                                      json={"messages": USER, "stream": True, "max_tokens": 2}))
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "H"}, {"content": "e"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_fans_out_with_offset_seeds(client, engine):
    body = client.post("/v1/chat/completions",
                       json={"messages": USER, "n": 2, "seed": 6, "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["wor", "orl"]
    assert sorted(p.seed for _, p in engine.requests.values()) == [6, 7]
    assert body["usage"]["completion_tokens"] == 6
    prompt_len = len(next(iter(engine.requests.values()))[0])
    assert body["usage"]["prompt_tokens"] == prompt_len  # the shared prompt counts once
    stream = sse_payloads(client.post("/v1/chat/completions", json={
        "messages": USER, "n": 2, "seed": 6, "max_tokens": 3, "stream": True}))
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in stream
                     if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == ["wor", "orl"]
    assert [c["choices"][0]["delta"].get("role") for c in stream[:2]] == ["assistant"] * 2


def test_completions_prompt_shapes_n_and_echo(client, engine):
    body = client.post("/v1/completions", json={
        "prompt": ["ab", "c"], "n": 2, "max_tokens": 2, "echo": True}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "abHe"), (1, "abHe"), (2, "cHe"), (3, "cHe")]
    assert body["usage"]["prompt_tokens"] == 3 + 2 and body["usage"]["completion_tokens"] == 8
    ids = client.post("/v1/completions", json={"prompt": [[104, 105]], "max_tokens": 1,
                                               "echo": True}).json()
    assert ids["choices"][0]["text"] == "hiH"


def test_completions_logprobs_and_stream(client):
    body = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3,
                                                "logprobs": 1}).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["H", "e", "l"], "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"H": -0.5}, {"e": -0.5}, {"l": -0.5}], "text_offset": [0, 1, 2]}
    chunks = sse_payloads(client.post("/v1/completions", json={
        "prompt": "ab", "max_tokens": 3, "stream": True, "echo": True, "logprobs": None}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abHel"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("payload, status, param, code, text", [
    ({"messages": []}, 400, "messages", "empty_messages", "messages is empty"),
    ({}, 400, "messages", "missing_required_parameter", "Missing required parameter"),
    ({"messages": USER, "model": "gpt-9"}, 404, "model", "model_not_found", "does not exist"),
    ({"messages": USER, "temperature": 3}, 400, "temperature", "invalid_value", "[0, 2]"),
    ({"messages": USER, "temperature": "hot"}, 400, "temperature", "invalid_type", '"hot"'),
    ({"messages": USER, "top_p": 0}, 400, "top_p", "invalid_value", "(0, 1]"),
    ({"messages": USER, "n": 200}, 400, "n", "invalid_value", "[1, 128]"),
    ({"messages": USER, "max_tokens": 0}, 400, "max_tokens", "invalid_value",
     ">= 1; send a positive number of tokens or omit it to generate up to the context window"),
    ({"messages": USER, "max_tokens": 60}, 400, "max_tokens", "context_length_exceeded",
     "exceeds max_model_len=64; lower max_tokens"),
    ({"messages": USER, "max_completion_tokens": 60}, 400, "max_completion_tokens",
     "context_length_exceeded", "exceeds max_model_len=64; lower max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 70}]}, 400, "messages",
     "context_length_exceeded", "max_model_len=64"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
     "messages[0].content[0]", "unsupported_content", "accepts text only"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema", "missing_required_parameter", "needs json_schema.schema"),
    # OpenAI's (and vLLM's) rule for the schema's name
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "integer"}}}}, 400, "response_format.json_schema.name",
     "missing_required_parameter", "needs a name"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "my schema!", "schema": {"type": "integer"}}}}, 400,
     "response_format.json_schema.name", "invalid_value", "letters, digits, '_' and '-'"),
    ({"messages": USER, "stop": 5}, 400, "stop", "invalid_type", "Invalid value for 'stop'"),
    ({"messages": "hi"}, 400, "messages", "invalid_type", "valid list"),
    # as OpenAI: no coercion of strings or booleans into numbers and flags
    ({"messages": USER, "max_tokens": "10"}, 400, "max_tokens", "invalid_type", "integer"),
    ({"messages": USER, "temperature": "0.5"}, 400, "temperature", "invalid_type", "number"),
    ({"messages": USER, "top_p": True}, 400, "top_p", "invalid_type", "number"),
    ({"messages": USER, "n": True}, 400, "n", "invalid_type", "integer"),
    ({"messages": USER, "stream": "yes"}, 400, "stream", "invalid_type", "boolean"),
    ({"messages": USER, "logprobs": 1}, 400, "logprobs", "invalid_type", "boolean"),
    ({"messages": USER, "reasoning_effort": "high"}, 400, "reasoning_effort",
     "unsupported_parameter", "not supported"),
    # found by black-box testing: any string was accepted
    ({"messages": USER, "service_tier": "bogus"}, 400, "service_tier", "invalid_type",
     "'auto', 'default', 'flex', 'scale' or 'priority'"),
])
def test_chat_bad_inputs(client, payload, status, param, code, text):
    assert_error(client.post("/v1/chat/completions", json=payload), status, param, code, text)


def test_malformed_and_missing_bodies_are_openai_400s(client):
    error = assert_error(client.post("/v1/chat/completions", content=b'{"messages": [',
                                     headers={"content-type": "application/json"}),
                         400, None, "invalid_json", "not valid JSON")
    assert error["type"] == "invalid_request_error"
    assert_error(client.post("/v1/completions"), 400, None, "invalid_json", "has no body")
    # found by black-box testing: these were FastAPI's bare "error parsing the body"
    for body in (b'{"prompt": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000,
                 b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"):
        assert_error(client.post("/v1/completions", content=body,
                                 headers={"content-type": "application/json"}),
                     400, None, "invalid_json", "could not be decoded as JSON")
    gzipped = gzip.compress(b'{"prompt": "hi"}')   # found by black-box testing
    assert_error(client.post("/v1/completions", content=gzipped,
                             headers={"content-type": "application/json",
                                      "content-encoding": "gzip"}),
                 400, None, "invalid_json", "Content-Encoding 'gzip' is not supported")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, None, "invalid_type")
    assert_error(client.post("/v1/chat/completions", content=b'{"messages": []}',
                             headers={"content-type": "text/plain"}),
                 400, None, "invalid_type", "Content-Type: application/json")
    error = assert_error(client.post("/v1/completions", json="hi"), 400, None, "invalid_type")
    assert "Content-Type" not in error["message"]   # it was JSON: a string, not an object
    assert_error(client.post("/v1/completions", json={"prompt": [1, 10**6]}), 400, "prompt",
                 "invalid_value", "outside the vocabulary")
    # a boolean is not a token id (it was read as id 1)
    assert_error(client.post("/v1/completions", json={"prompt": [104, True]}), 400, "prompt",
                 "invalid_type", "valid integer")


@pytest.mark.parametrize("prompt, what", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
     "a content part of type 'image_url'"),
    (["describe", {"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
     "a content part of type 'image_url'"),
    ([{"type": "text", "text": "hi"}], "a content part of type 'text'"),
    ({"prompt": "hi", "multi_modal_data": {"image": "x"}}, "an object"),   # vLLM's offline form
])
def test_completions_with_images_or_parts_say_where_images_go(client, prompt, what):
    error = assert_error(client.post("/v1/completions", json={"prompt": prompt}), 400,
                         "prompt", "invalid_type", f"the prompt holds {what}")
    assert "takes text prompts only" in error["message"]
    assert "/v1/chat/completions as 'image_url' parts" in error["message"]


def test_bad_kv_transfer_params_are_400_with_a_code(client):
    def post(**fields):
        return client.post("/v1/completions", json={"prompt": "hi", **fields})

    assert_error(post(kv_transfer_params={"do_remote_decode": "yes"}), 400,
                 "kv_transfer_params", "invalid_type", "must be true or false")
    assert_error(post(kv_transfer_params={"do_remote_decode": True}, n=2), 400,
                 "kv_transfer_params", "invalid_value", "exactly one choice")
    assert_error(post(kv_transfer_params={"do_remote_decode": True}, stream=True), 400,
                 "kv_transfer_params", "invalid_value", "stream=false")


def test_vllm_extras_not_served_are_named(client):
    for body, param in (({"add_generation_prompt": False}, "add_generation_prompt"),
                        ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
                         "stream_options.continuous_usage_stats")):
        assert_error(client.post("/v1/chat/completions", json={"messages": USER, **body}), 400,
                     param, "unsupported_parameter", "a vLLM extension")


def test_more_choices_than_the_server_ever_holds_is_400_not_429(client, engine):
    """A 429 would be retried forever (found by black-box testing: 300 prompts on a server
    holding 260 requests)."""
    engine.max_in_flight = 5
    error = assert_error(client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3}),
                         400, "prompt", "invalid_value", "6 choices")
    assert "5 requests this server holds at once" in error["message"]
    assert_error(client.post("/v1/completions", json={"prompt": "a", "n": 6}), 400, "n",
                 "invalid_value", "6 choices")   # the field to shrink: n, or the prompt list
    assert client.post("/v1/completions", json={"prompt": ["a"], "n": 5}).status_code == 200


def test_unknown_routes_and_methods(client):
    assert_error(client.get("/v1/nope"), 404, text="No route GET /v1/nope")
    assert_error(client.get("/v1/chat/completions"), 405, text="not allowed")


def test_queue_full_is_429_stream_or_not(client, engine):
    engine.queue_full = True
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json={"messages": USER,
                                                               "stream": stream})
        error = assert_error(response, 429, None, "rate_limit_exceeded", "max_waiting_requests")
        assert error["type"] == "rate_limit_error" and response.headers["retry-after"] == "1"


def test_unexpected_engine_error_is_a_logged_500(client, engine, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("kaboom")
        yield  # pragma: no cover

    engine.generate = broken
    error = assert_error(client.post("/v1/completions", json={"prompt": "a"}), 500, None,
                         "internal_error", "RuntimeError")
    assert error["type"] == "server_error"
    assert "kaboom" in caplog.text


def test_api_key_guards_v1_only(engine):
    client = TestClient(build_app(engine, api_key="s3cret"))
    assert_error(client.get("/v1/models"), 401, None, "invalid_api_key", "no API key")
    assert_error(client.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401, None,
                 "invalid_api_key", "a wrong API key")
    ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_metrics_move_with_requests(client):
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4})
    text = client.get("/metrics").text
    assert 'deepinfer:generation_tokens_total{model_name="test-model"} 4.0' in text
    assert 'deepinfer:prompt_tokens_total{model_name="test-model"} 3.0' in text
    assert ('deepinfer:request_success_total{finished_reason="length",model_name="test-model"} '
            '1.0') in text


def test_http_requests_are_counted_by_route_template_and_status(engine):
    client = TestClient(build_app(engine, api_key="k"), raise_server_exceptions=False)
    auth = {"Authorization": "Bearer k"}
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=auth)
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": -1}, headers=auth)
    client.get("/v1/models/test-model", headers=auth)
    client.get("/v1/models/other", headers=auth)
    client.get("/v1/models")                       # no key: refused before routing
    client.get("/no/such/path/1")
    client.get("/no/such/path/2")
    engine.queue_full = True
    client.post("/v1/completions", json={"prompt": "ab"}, headers=auth)
    text = client.get("/metrics").text

    def count(route: str, status: int) -> str:
        return (f'deepinfer:http_requests_total{{model_name="test-model",route="{route}",'
                f'status_code="{status}"}}')

    for route, status, n in (("/v1/completions", 200, 1), ("/v1/completions", 400, 1),
                             ("/v1/completions", 429, 1), ("/v1/models/{model_id:path}", 200, 1),
                             ("/v1/models/{model_id:path}", 404, 1), ("unmatched", 401, 1),
                             ("unmatched", 404, 2)):
        assert f"{count(route, status)} {float(n)}" in text, (route, status, text)


def test_the_api_docs_need_the_key_when_one_is_set(engine):
    """Issue 26.7: /docs, /redoc and /openapi.json were open with --api-key set."""
    client = TestClient(build_app(engine, api_key=("s3cret", "second")))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(client.get(path), 401, None, "invalid_api_key", "no API key")
        for key in ("s3cret", "second"):
            assert client.get(path, headers={"Authorization": f"Bearer {key}"}).status_code \
                == 200
    assert TestClient(build_app(engine)).get("/openapi.json").status_code == 200


def test_cache_salt_by_isolation_mode():
    from types import SimpleNamespace

    from deepinfer.server.app import cache_salt

    def body(salt=None, user=None):
        return SimpleNamespace(cache_salt=salt, user=user)

    assert cache_salt(body(), "Bearer k", "none") is None
    assert cache_salt(body("t1"), "Bearer k", "none") == "salt:t1"
    assert cache_salt(body(user="alice"), "", "user") == "user:alice"
    assert cache_salt(body(user="alice"), "", "user") != cache_salt(body(user="bob"), "", "user")
    assert cache_salt(body(), "", "user") == "user:"   # no user: its own pool, not the shared one
    by_key = cache_salt(body(), "Bearer k1", "api-key")
    assert by_key.startswith("key:") and "k1" not in by_key   # a digest, never the key
    assert by_key != cache_salt(body(), "Bearer k2", "api-key")
    assert cache_salt(body(""), "", "user") == ""   # refused by validation with its message


def test_an_empty_cache_salt_is_a_400(client):
    assert_error(client.post("/v1/completions", json={"prompt": "a", "cache_salt": ""}), 400,
                 "cache_salt", "invalid_value", "cache_salt is empty")


def test_draining_health_is_503_and_liveness_stays_200(engine):
    """Issue 26.4: after SIGTERM (server.cli sets `draining`) /health says draining so routers
    and readiness probes send nothing new; /liveness (the liveness probe) stays 200."""
    app = build_app(engine)
    client = TestClient(app)
    assert client.get("/health").json() == {"status": "ok"}
    app.state.draining = True
    reply = client.get("/health")
    assert reply.status_code == 503 and reply.json()["status"] == "draining"
    assert client.get("/liveness").status_code == 200
    assert client.head("/liveness").status_code == 200
