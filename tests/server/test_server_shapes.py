"""Logprobs shapes, SSE framing, pydantic error bodies and metric names, on pure functions."""

import json
import math

from pydantic import ValidationError

from deepinfer.engine.outputs import RequestMetrics, RequestOutput, SchedulerStats, TokenLogprobs
from deepinfer.server.errors import APIError, validation_error
from deepinfer.server.logprobs import (CompletionLogprobsBuilder, TokenDecoder, chat_logprobs,
                             merge_completion_logprobs)
from deepinfer.server.metrics import ServerMetrics, token_buckets
from deepinfer.server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                             DeltaMessage)
from deepinfer.server.sse import DONE, sse_error, sse_event
from server_doubles import CharTokenizer


class PartialUtf8Tokenizer(CharTokenizer):
    """Ids 300 and 301 are the first byte of a 3-byte character, in byte-level BPE and in
    sentencepiece byte-fallback spelling; decoding either alone gives U+FFFD."""

    def decode(self, ids, skip_special_tokens=False):
        return "\ufffd" if ids[0] in (300, 301) else super().decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, token_id):
        return {300: "â", 301: "<0xE2>"}.get(token_id) or super().convert_ids_to_tokens(token_id)


def test_chat_logprobs_shape_and_bytes():
    decode = TokenDecoder(CharTokenizer())
    shaped = chat_logprobs(decode, [TokenLogprobs(104, -0.25, 1, [(104, -0.25), (106, -2.0)]),
                                    TokenLogprobs(105, -float("inf"), 3, [])])
    body = shaped.model_dump()
    assert body["content"][0] == {
        "token": "h", "logprob": -0.25, "bytes": [104],
        "top_logprobs": [{"token": "h", "logprob": -0.25, "bytes": [104]},
                         {"token": "j", "logprob": -2.0, "bytes": [106]}]}
    assert body["content"][1]["logprob"] == -9999.0  # JSON has no -inf
    assert body["refusal"] is None
    json.dumps(body, allow_nan=False)


def test_partial_utf8_tokens_get_their_real_bytes():
    decode = TokenDecoder(PartialUtf8Tokenizer())
    assert decode(300) == ("\ufffd", [0xE2])
    assert decode(301) == ("\ufffd", [0xE2])
    assert decode(ord("é")) == ("é", [0xC3, 0xA9])


def test_completion_logprobs_offsets_continue_across_chunks():
    builder = CompletionLogprobsBuilder(TokenDecoder(CharTokenizer()), start_offset=3)
    first = builder.add([TokenLogprobs(104, -0.5, 1, [(104, -0.5), (120, -1.5)])])
    second = builder.add([TokenLogprobs(105, -0.1, 2, [(106, -0.05)])])
    merged = merge_completion_logprobs([first, second]).model_dump()
    assert merged == {"tokens": ["h", "i"], "token_logprobs": [-0.5, -0.1],
                      "top_logprobs": [{"h": -0.5, "x": -1.5}, {"j": -0.05, "i": -0.1}],
                      "text_offset": [3, 4]}


def test_sse_framing():
    chunk = ChatCompletionChunk(id="c1", created=5, model="m", choices=[
        ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    event = sse_event(chunk, exclude={"usage"})
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    payload = json.loads(event[len(b"data: "):])
    assert payload == {"id": "c1", "created": 5, "model": "m", "system_fingerprint": None,
                       "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None,
                                    "stop_reason": None}]}
    final = ChatChunkChoice(index=0, delta=DeltaMessage(), finish_reason="stop")
    assert json.loads(final.model_dump_json())["delta"] == {}
    assert DONE == b"data: [DONE]\n\n"
    err = json.loads(sse_error(APIError("boom", status_code=500, type="server_error"))[6:])
    assert err == {"error": {"message": "boom", "type": "server_error", "param": None,
                             "code": None}}


def _errors(body: dict) -> list:
    try:
        ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        return exc.errors()
    raise AssertionError("expected a validation error")


def test_pydantic_errors_become_openai_400s():
    missing = validation_error(_errors({"model": "m"}))
    assert missing.message == "Missing required parameter: 'messages'."
    assert (missing.status_code, missing.param) == (400, "messages")
    wrong = validation_error(_errors({"messages": [{"role": "user", "content": 5}]}))
    assert wrong.param == "messages[0].content"
    assert "Invalid value for 'messages[0].content': 5." in wrong.message
    assert "valid string" in wrong.message and "valid list" in wrong.message
    typo = validation_error(_errors({"messages": [], "max_token": 3}))
    assert typo.message.startswith("Unrecognized request argument supplied: 'max_token'")
    role = validation_error(_errors({"messages": [{"role": "wizard", "content": "x"}]}))
    assert role.param == "messages[0].role" and '"wizard"' in role.message
    bad_json = validation_error([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON",
                                  "ctx": {"error": "Expecting value"}}])
    assert bad_json.message.startswith("The request body is not valid JSON (Expecting value)")


def test_token_buckets_span_the_context_window():
    assert token_buckets(64) == [1, 2, 5, 10, 20, 50]
    assert token_buckets(8192)[-1] == 5000


def test_metric_names_and_tracker():
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5,
                           prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=2)
    metrics = ServerMetrics(lambda: stats, "tiny", 2048)
    arrival = 100.0
    request_metrics = RequestMetrics(arrival_time=arrival, first_token_time=100.2,
                                     last_token_time=100.2)
    tracker = metrics.tracker()
    tracker.observe(RequestOutput("r", [1, 2, 3], [7], "a", None, 1, 0, False, None, None,
                                  request_metrics))
    request_metrics.last_token_time = 100.25
    request_metrics.finished_time = 100.3
    tracker.observe(RequestOutput("r", [1, 2, 3], [8, 9], "bc", None, 3, 0, True, "length", None,
                                  request_metrics))
    tracker.close()
    aborted = metrics.tracker()
    aborted.observe(RequestOutput("s", [1], [], "", None, 0, 0, False, None, None,
                                  RequestMetrics(arrival_time=100.0)))
    aborted.close()
    metrics.tracker().close()                          # aborted while waiting: no output
    metrics.tracker().close(count_unstarted=False)     # refused by the engine: not counted
    text = metrics.render().decode()
    expected = {
        'deepinfer:num_requests_running{model_name="tiny"} 3.0',
        'deepinfer:num_requests_waiting{model_name="tiny"} 1.0',
        'deepinfer:kv_cache_usage_perc{model_name="tiny"} 0.5',
        'deepinfer:prefix_cache_queries_total{model_name="tiny"} 40.0',
        'deepinfer:prefix_cache_hits_total{model_name="tiny"} 16.0',
        'deepinfer:num_preemptions_total{model_name="tiny"} 2.0',
        'deepinfer:prompt_tokens_total{model_name="tiny"} 4.0',
        'deepinfer:generation_tokens_total{model_name="tiny"} 3.0',
        'deepinfer:request_success_total{finished_reason="length",model_name="tiny"} 1.0',
        'deepinfer:request_success_total{finished_reason="abort",model_name="tiny"} 2.0',
        'deepinfer:time_to_first_token_seconds_count{model_name="tiny"} 1.0',
        'deepinfer:inter_token_latency_seconds_count{model_name="tiny"} 1.0',
        'deepinfer:e2e_request_latency_seconds_count{model_name="tiny"} 2.0',
        'deepinfer:request_prompt_tokens_sum{model_name="tiny"} 4.0',
        'deepinfer:request_generation_tokens_sum{model_name="tiny"} 3.0',
    }
    lines = set(text.splitlines())
    assert expected <= lines, expected - lines
    ttft_sum = next(line for line in lines
                    if line.startswith("deepinfer:time_to_first_token_seconds_sum"))
    assert math.isclose(float(ttft_sum.split()[-1]), 0.2, abs_tol=1e-9)
    itl_sum = next(line for line in lines
                   if line.startswith("deepinfer:inter_token_latency_seconds_sum"))
    assert math.isclose(float(itl_sum.split()[-1]), 0.05, abs_tol=1e-9)
    assert 'deepinfer:time_to_first_token_seconds_bucket{le="0.001",model_name="tiny"}' in text
    assert 'deepinfer:time_to_first_token_seconds_bucket{le="640.0",model_name="tiny"}' in text


def test_two_apps_have_separate_registries():
    a = ServerMetrics(SchedulerStats, "a", 16)
    b = ServerMetrics(SchedulerStats, "b", 16)
    a.prompt_tokens.inc(5)
    assert 'deepinfer:prompt_tokens_total{model_name="a"} 5.0' in a.render().decode()
    assert 'deepinfer:prompt_tokens_total{model_name="b"} 0.0' in b.render().decode()
