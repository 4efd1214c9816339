"""The real `deepinfer serve` process with the embedded default model, driven by the official
`openai` client (and httpx where a client would not send such a request).

One server per module; it is killed at teardown whatever happens. The last test sends SIGTERM
and checks that an in-flight stream still finishes before the process exits.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import ServerProcess, deepinfer, sigterm_during

pytestmark = pytest.mark.slow

MODEL = "smollm2-e2e"
STARTUP_TIMEOUT_S = 900  # the first run converts the GGUF model into the cache
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def start_server(tmp: Path) -> ServerProcess:
    return ServerProcess("server", deepinfer(
        "serve", "--served-model-name", MODEL, "--max-num-seqs", "8", "--log-level", "info",
        "--graceful-shutdown-s", "60"), tmp / "server.log")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("e2e"))
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    wanted = {"model_name": MODEL, **labels}
    return sum(v for (n, lbls), v in metrics(server).items()
               if n == name and wanted.items() <= dict(lbls).items())


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] >= 2048
    assert httpx.get(server.url + "/health").status_code == 200
    assert f"serving '{MODEL}' at {server.url}/v1" in server.log()


def test_chat_answers_paris_and_stream_matches(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=32)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 10 and 1 <= usage.completion_tokens <= 32
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same tokens either way
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is chunks[-2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        usage.completion_tokens


def test_repeated_prompt_reports_cached_tokens(client):
    for _ in range(2):
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                               max_tokens=2)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < reply.usage.prompt_tokens  # whole blocks of the repeated prompt


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=4, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy picks the most likely
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_completions(client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert plain.object == "text_completion" and plain.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    scored = client.completions.create(model=MODEL, prompt=[prompt, "1, 2, 3,"], max_tokens=5,
                                       temperature=0, logprobs=2)
    assert [c.index for c in scored.choices] == [0, 1]
    lp = scored.choices[0].logprobs
    assert "".join(lp.tokens) == scored.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and all(len(top) >= 2 for top in lp.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert streamed == plain.choices[0].text


def test_n_with_seed_is_reproducible(client):
    def sample():
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a short story."}],
            n=2, seed=1234, temperature=1.0, max_tokens=16)
        assert [c.index for c in reply.choices] == [0, 1]
        return [c.message.content for c in reply.choices]

    first = sample()
    assert all(first) and first == sample()


@pytest.mark.parametrize("kwargs, status, code, text", [
    ({"temperature": 3}, 400, "invalid_value", "temperature=3"),
    ({"max_tokens": 10**6}, 400, "context_length_exceeded", "exceeds max_model_len="),
    ({"model": "gpt-4o"}, 404, "model_not_found", "`gpt-4o` does not exist"),
    ({"messages": []}, 400, "empty_messages", "messages is empty"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     400, "unsupported_content", "accepts text only"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "missing_required_parameter", "needs json_schema.schema"),
])
def test_bad_inputs_get_openai_errors(client, kwargs, status, code, text):
    request = {"model": MODEL, "messages": QUESTION, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**request)
    assert info.value.status_code == status
    assert info.value.code == code and text in info.value.message


def test_malformed_json_is_400(server):
    response = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_disconnect_mid_stream_frees_kv_blocks(server):
    aborts_before = metric(server, "deepinfer:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line)
        for _ in range(6):
            assert next(events).startswith("data: {")
        assert metric(server, "deepinfer:num_requests_running") == 1
        assert metric(server, "deepinfer:kv_cache_usage_perc") > 0
    # leaving the block closed the connection mid-stream
    assert _wait_for(lambda: metric(server, "deepinfer:num_requests_running") == 0
                     and metric(server, "deepinfer:kv_cache_usage_perc") == 0, 5.0), \
        metrics(server)
    assert metric(server, "deepinfer:request_success_total",
                  finished_reason="abort") == aborts_before + 1


class CityFacts(pydantic.BaseModel):
    city: str
    country: str
    population_millions: float
    landmarks: list[str] = pydantic.Field(max_length=3)


def test_structured_output_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Give facts about Paris as JSON with "
                                "keys city, country, population_millions, landmarks."}],
        response_format=CityFacts, max_tokens=120, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    facts = choice.message.parsed
    assert isinstance(facts, CityFacts) and len(facts.landmarks) <= 3
    assert CityFacts.model_validate_json(choice.message.content) == facts


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}


def test_required_tool_call_arguments_validate_streamed_or_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER_TOOL], tool_choice="required", max_tokens=60, temperature=0)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    arguments, names = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta_call.function.name:
                names.append(delta_call.function.name)
            if delta_call.index == 0:
                arguments += delta_call.function.arguments or ""
    assert names[0] == "get_weather" and arguments == call.function.arguments


def test_vllm_choice_and_regex_constraints(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], n=3,
        seed=5, temperature=1.0, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert all(c.message.content in ("yes", "no") and c.finish_reason == "stop"
               for c in reply.choices)
    regex = r"[A-Z][a-z]{2,8}, [A-Z][a-z]{2,8}"
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France, the country:", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}})
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, completion.choices[0].text)


def test_invalid_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {
                    "x": {"type": "string", "pattern": "(unclosed"}}}}})
    assert "Invalid response_format" in info.value.message
    assert "parenthesis" in info.value.message


def test_metrics_counters_moved(server):
    assert metric(server, "deepinfer:prompt_tokens_total") > 50
    assert metric(server, "deepinfer:generation_tokens_total") > 50
    assert metric(server, "deepinfer:request_success_total", finished_reason="length") > 0
    assert metric(server, "deepinfer:time_to_first_token_seconds_count") > 5
    assert metric(server, "deepinfer:inter_token_latency_seconds_count") > 5
    assert metric(server, "deepinfer:e2e_request_latency_seconds_count") > 5
    assert metric(server, "deepinfer:prefix_cache_hits_total") > 0
    assert metric(server, "deepinfer:prefix_cache_queries_total") >= \
        metric(server, "deepinfer:prefix_cache_hits_total")


def test_sigterm_lets_the_in_flight_stream_finish(server):
    """Must stay last: it stops the module's server."""
    events, _ = sigterm_during(server, {"model": MODEL, "messages": QUESTION, "max_tokens": 24,
                                        "ignore_eos": True})
    assert events[-1] == "data: [DONE]"
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert "deepinfer: stopped" in log and "Traceback" not in log
