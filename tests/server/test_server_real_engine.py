"""The app in-process on the real AsyncLLM (embedded SmolLM2) through httpx's ASGI transport:
the real tokenizer's chat template and bytes, stop strings, the context window, queue full,
structured-output constraints the real compilers refuse (or honour)."""

import asyncio
import json

import httpx
import jsonschema
import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.server.app import build_app
from deepinfer.server.logprobs import TokenDecoder
from deepinfer.server.prompts import chat_prompt_ids
from deepinfer.server.protocol import ChatMessage

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine():
    from deepinfer.engine.async_llm import AsyncLLM

    config = EngineConfig().replace(model={"max_model_len": 512, "device": "cpu"},
                                    scheduler={"max_num_seqs": 1, "max_waiting_requests": 1})
    llm = AsyncLLM(config)
    yield llm
    llm.shutdown()


def post_all(engine, *bodies, path="/v1/chat/completions") -> list[httpx.Response]:
    async def run():
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as client:
            return await asyncio.gather(*(client.post(path, json=b) for b in bodies))

    return asyncio.run(run())


def test_real_tokenizer_bytes_of_a_split_character(engine):
    decode = TokenDecoder(engine.tokenizer)
    ids = engine.tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2  # byte-level BPE splits the emoji
    pieces = [decode(i) for i in ids]
    assert all("\ufffd" in text for text, _ in pieces)
    assert b"".join(bytes(raw) for _, raw in pieces) == "🙂".encode()


def test_chat_prompt_is_the_rendered_template(engine):
    tok = engine.tokenizer
    ids = chat_prompt_ids(tok, [ChatMessage(**m) for m in QUESTION], 8192)
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and text.endswith("assistant\n")
    response, = post_all(engine, {"messages": QUESTION, "max_tokens": 1})
    assert response.json()["usage"]["prompt_tokens"] == len(ids)


def test_stop_string_ends_the_answer(engine):
    response, = post_all(engine, {"messages": QUESTION, "temperature": 0, "max_tokens": 32,
                                  "stop": ["Paris"]})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "Paris"
    assert "Paris" not in choice["message"]["content"]
    assert choice["message"]["content"].startswith("The capital of France is")


def test_context_window_is_enforced_with_numbers(engine):
    response, = post_all(engine, {"messages": QUESTION, "max_tokens": 600})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("max_tokens=600 plus ") and "exceeds max_model_len=512" in message


def test_a_stop_token_id_outside_the_vocabulary_is_400(engine):
    response, = post_all(engine, {"messages": QUESTION, "max_tokens": 4,
                                  "stop_token_ids": [999999]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "stop_token_ids holds token id 999999, outside the vocabulary [0, 49152)" in \
        error["message"]
    assert (error["param"], error["code"]) == ("stop_token_ids", "invalid_value")


def test_full_queue_answers_429(engine):
    body = {"messages": QUESTION, "max_tokens": 8, "ignore_eos": True}
    responses = post_all(engine, body, body, body, body)
    statuses = sorted(r.status_code for r in responses)
    # in flight at most max_num_seqs + max_waiting_requests = 2; how many of the 4 get in
    # depends on whether the first was scheduled before the others arrived
    assert set(statuses) == {200, 429} and statuses.count(200) <= 2, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["retry-after"] == "1"


def spelled_bytes(name: str) -> bytes:
    """The bytes a completions token name stands for (`bytes:\\xNN...` or its UTF-8 text)."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode("utf-8")


@pytest.mark.parametrize("prompt", ["日本の首都は東京です。中国の首都は",
                                    "Emoji: 🙂😀🎉 and more emoji:"])
def test_completions_logprobs_of_multibyte_text(engine, prompt):
    """Issue 27 item 3: tokens holding part of a CJK character or an emoji are spelled by their
    bytes, 5 alternatives asked give 5, the sampled token keeps its own logprob; the stream
    says the same."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 5}
    plain, = post_all(engine, body, path="/v1/completions")
    choice = plain.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert any(t.startswith("bytes:\\x") for t in logprobs["tokens"])
    assert b"".join(spelled_bytes(t) for t in logprobs["tokens"]) == choice["text"].encode()
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                   logprobs["top_logprobs"]):
        assert len(top) == 5 and top[token] == logprob   # greedy: the sampled one is in the 5
    assert sum(t.startswith("bytes:") for top in logprobs["top_logprobs"] for t in top) > 8
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert logprobs["text_offset"][-1] < len(choice["text"])

    streamed, = post_all(engine, {**body, "stream": True}, path="/v1/completions")
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n\n")
              if line.startswith("data: {")]
    merged = {key: [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"][key]] for key in logprobs}
    assert merged == logprobs


def test_chat_logprobs_end_with_the_text(engine):
    """Issue 27 item 3: the end-of-turn token stops the answer and is not shown, so it is not
    listed either; the listed tokens' bytes are the answer's."""
    response, = post_all(engine, {"messages": QUESTION, "temperature": 0, "max_tokens": 100,
                                  "logprobs": True, "top_logprobs": 2})
    body = response.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    content = choice["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == choice["message"]["content"].encode()
    assert len(content) == body["usage"]["completion_tokens"] - 1   # EOS counted, not listed
    assert all("<|im_end|>" not in e["token"] for e in content)

    streamed, = post_all(engine, {"messages": QUESTION, "temperature": 0, "max_tokens": 100,
                                  "logprobs": True, "top_logprobs": 2, "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n\n")
              if line.startswith("data: {")]
    assert [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content") or []
            ] == content


# found by a fresh-user test: each was a 200 under XGrammar (LLGuidance: "Unsatisfiable schema")
BAD_SCHEMAS = [
    ({"type": "string", "const": 5},
     "the 'const' value 5 at # fails the rest of its schema (5 is not of type \"string\")"),
    ({"type": "integer", "enum": ["a", "b"]}, "the 'enum' value \"a\" at # fails"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "const": {"b": 1}}, '("a" is a required property)'),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": False, "const": {"a": 1, "b": 2}}, '("b" was unexpected)'),
    ({"type": "string", "enum": ["a", None]}, "the 'enum' value null at #"),
    ({"anyOf": []}, "[] should be non-empty at #/anyOf"),
    ({"oneOf": []}, "[] should be non-empty at #/oneOf"),
    ({"type": []}, "not a valid JSON schema: [] should be non-empty at #/type"),
    ({"type": ["string", "string"]}, "has non-unique elements at #/type"),
    ({"$defs": 5, "type": "object"}, '5 is not of type "object" at #/$defs'),
    ({"allOf": []}, "[] should be non-empty at #/allOf"),
    ({"$schema": "http://example.com/not-a-metaschema", "type": "object"},
     "'$schema': \"http://example.com/not-a-metaschema\" at # is not the URL of a JSON Schema "
     "meta-schema this server knows; use one of \"https://json-schema.org/draft/2020-12/schema\""),
]
# (path, the request's constraint fields, the parameter its 400 names): each surface, and the
# backends auto (XGrammar for these), guidance and xgrammar
SURFACES = [
    ("/v1/chat/completions", lambda schema: {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", lambda schema: {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", lambda schema: {"structured_outputs": {
        "json": schema, "backend": "guidance"}}, "structured_outputs.json"),
    ("/v1/completions", lambda schema: {"guided_json": schema,
                                        "structured_outputs": {"backend": "xgrammar"}},
     "guided_json"),
]


@pytest.mark.parametrize("path, fields, param", SURFACES)
def test_invalid_or_unsatisfiable_schemas_are_the_same_400_everywhere(engine, path, fields,
                                                                       param):
    base = {"messages": QUESTION} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    bodies = [{**base, "max_tokens": 8, **fields(schema)} for schema, _ in BAD_SCHEMAS]
    for (schema, text), response in zip(BAD_SCHEMAS, post_all(engine, *bodies, path=path)):
        assert response.status_code == 400, (schema, response.text)
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", param, "invalid_schema"), error
        assert error["message"].startswith(f"Invalid {param}: "), error
        assert text in error["message"], (text, error)
        assert any(fix in error["message"] for fix in (
            "drop the value or change the other keywords",
            "fix the schema (checked against the JSON Schema metaschema",
            "(or leave '$schema' out for Draft 2020-12)")), error
        assert error["message"].lower().count("fix") <= 1, error   # the advice, said once


@pytest.mark.parametrize("tool_choice", ["auto", "required",
                                         {"type": "function", "function": {"name": "unit"}}])
def test_a_bad_tool_schema_is_a_400_naming_its_tool_under_every_choice(engine, tool_choice):
    """Under "required" / named the engine's compile is the schema's only check (the server
    checks the other tools'); its refusal still names the tool, not "tools"."""
    city = {"type": "function", "function": {"name": "city", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}}}}
    unit = {"type": "function", "function": {"name": "unit", "parameters": {
        "$defs": {"u": {"type": "string", "enum": ["C", None]}}, "type": "object",
        "properties": {"u": {"$ref": "#/$defs/u"}}}}}
    [response] = post_all(engine, {"messages": QUESTION, "max_tokens": 8,
                                   "tools": [city, unit], "tool_choice": tool_choice})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("tools[1].function.parameters",
                                               "invalid_schema"), error
    assert ("the 'enum' value null at #/$defs/u fails the rest of its schema (null is not of "
            'type "string")') in error["message"], error


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_bad_regex_or_grammar_is_a_400_naming_it(engine, backend):
    bodies = [{"messages": QUESTION, "structured_outputs": {"regex": "a(b", "backend": backend}},
              {"messages": QUESTION, "structured_outputs": {"grammar": "root ::= (",
                                                            "backend": backend}}]
    for (param, text), response in zip(
            [("structured_outputs.regex", "regex"), ("structured_outputs.grammar", "grammar")],
            post_all(engine, *bodies)):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_schema"), error
        assert error["message"].startswith(f"Invalid {param}: ") and text in error["message"]


def test_a_good_schema_gives_json_that_validates(engine):
    schema = {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Lyon"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "population_millions"], "additionalProperties": False}
    response, = post_all(engine, {"messages": QUESTION, "temperature": 0, "max_tokens": 40,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "city", "schema": schema}}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
