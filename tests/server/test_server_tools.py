"""Structured-output fields and tool calling through the HTTP layer, on the scripted engine:
every spelling maps to the right `so_args`, bad constraints are 400s before anything is queued,
tool calls come back in OpenAI's shape, streamed or not, and tool turns reach the template."""

import asyncio
import json
import random
import re
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from deepinfer.server.app import build_app
from deepinfer.server.tool_parser import CallArrayStreamer, HermesStreamer, NamedCallStreamer
from deepinfer.server.tools import template_inputs, tool_config
from deepinfer.server.protocol import ChatCompletionRequest
from server_doubles import ScriptedEngine

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def client_for(reply: str = "Hello world") -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(reply=reply, max_model_len=4096)
    return TestClient(build_app(engine), raise_server_exceptions=False), engine


def sent_params(engine: ScriptedEngine):
    return [params for _, params in engine.requests.values()]


@pytest.mark.parametrize("fields, so_args", [
    ({"response_format": {"type": "json_object"}}, {"schema_type": "json_object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}},
     {"schema_type": "json", "schema": SCHEMA}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, {"schema_type": "json", "schema": SCHEMA}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"schema_type": "regex", "schema": "[a-z]+"}),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     {"schema_type": "ebnf", "schema": 'root ::= "a"'}),
    ({"structured_outputs": {"choice": ["yes", "no?", "a.b"]}},
     {"schema_type": "regex", "schema": r"(yes|no\?|a\.b)"}),
    ({"structured_outputs": {"json_object": True}}, {"schema_type": "json_object"}),
    ({"guided_json": SCHEMA}, {"schema_type": "json", "schema": SCHEMA}),
    ({"guided_regex": "x+"}, {"schema_type": "regex", "schema": "x+"}),
    ({"guided_grammar": 'root ::= "b"'}, {"schema_type": "ebnf", "schema": 'root ::= "b"'}),
    ({"guided_choice": ["Zürich", "东京"]}, {"schema_type": "regex", "schema": "(Zürich|东京)"}),
])
def test_every_spelling_maps_to_so_args(fields, so_args):
    client, engine = client_for()
    response = client.post("/v1/chat/completions", json={"messages": USER, "n": 2, **fields})
    assert response.status_code == 200, response.text
    assert [p.so_args for p in sent_params(engine)] == [so_args, so_args]
    assert engine.compiled == ([so_args] if so_args else [])


def test_completions_take_structured_fields():
    client, engine = client_for()
    response = client.post("/v1/completions", json={"prompt": "a", "guided_regex": "[0-9]+"})
    assert response.status_code == 200, response.text
    assert sent_params(engine)[0].so_args == {"schema_type": "regex", "schema": "[0-9]+"}
    response = client.post("/v1/completions", json={   # response_format too, as vLLM
        "prompt": "b", "response_format": {"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA}}})
    assert response.status_code == 200, response.text
    assert sent_params(engine)[1].so_args == {"schema_type": "json", "schema": SCHEMA}


@pytest.mark.parametrize("fields, param, text", [
    ({"guided_regex": "a(INVALID"}, "guided_regex", "Invalid guided_regex: invalid or "
                                                    "unsupported regex: Regex parsing error"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "INVALID"}}}}, "response_format.json_schema.schema",
     "Invalid response_format.json_schema.schema: "),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs", "unsupported field"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_regex", "Only one structured"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    # found by black-box testing: 20,000 choices compiled for minutes on both CPU cores
    ({"guided_choice": [f"choice number {i}" for i in range(20000)]}, "guided_choice",
     "the limit is 65536"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12000)}}}}},
     "response_format.json_schema.schema", "Shorten it"),
    ({"structured_outputs": {"grammar": "root ::= \"a\"" + " " * 70000}},
     "structured_outputs.grammar", "the constraint's text is 70012 characters"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "cannot be used with it"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice",
     'must be "none", "auto", "required" or'),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", "letters, digits"),
    # found by the s55 new-user trial: a missing "function" was blamed on its name
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object with at least"),
    # found by black-box testing: a non-object "function" in tool_choice was a 500
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice", 'must be "none", "auto", "required" or'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": ["x"]}},
     "tool_choice", 'must be "none", "auto", "required" or'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": "required"},
     "tools[0].function.parameters", "of type 'object'"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "unique name"),
    # found by black-box testing: an invalid schema was refused only when a call was forced
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]},
     "tools[0].function.parameters", 'not a valid JSON schema: "nonsense" is not valid'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["C", None]}}}}}]},
     "tools[0].function.parameters", "Invalid tools[0].function.parameters: the 'enum' value "
                                     "null at #/properties/unit fails the rest of its schema"),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens", "cannot be combined with "
                                                          "structured outputs"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "'required' / named tool_choice"),
    # a stop string cut a required call's arguments to '{"city": "Paris", "' with
    # finish_reason "tool_calls"
    ({"tools": [WEATHER], "tool_choice": "required", "stop": ["unit"]}, "stop",
     'stop=["unit"] cannot be combined'),
    ({"guided_json": SCHEMA, "stop": "}"}, "stop", "drop stop"),
    ({"tools": [WEATHER], "messages": USER + [{"role": "tool", "content": "sunny"}]},
     "messages[1]", "no tool_call_id"),
    # tool results that answer no call reached the template
    ({"tools": [WEATHER], "messages": USER + [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     "messages[1]", "does not follow an assistant message with tool_calls"),
    ({"tools": [WEATHER], "messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_9", "content": "rain"}]},
     "messages[3].tool_call_id", '"call_9" is not the id of a call in messages[1].tool_calls '
                                '("call_1")'),
    ({"tools": [WEATHER], "messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]},
     "messages[4]", "does not follow an assistant message with tool_calls"),
])
def test_bad_constraints_and_tools_are_400_before_queueing(fields, param, text):
    client, engine = client_for()
    response = client.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error
    # found by black-box testing: "send a JSON object.. Fix it" (an ellipsis is fine)
    assert not re.search(r"(?<!\.)\.\.(?!\.)", error["message"]), error
    assert engine.requests == {}


@pytest.mark.parametrize("field, value, text", [("strict", "yes", 'true or false, got "yes"'),
                                               ("description", 5, "a string, got 5")])
def test_a_tool_field_of_the_wrong_type_is_invalid_type(field, value, text):
    client, engine = client_for()
    response = client.post("/v1/chat/completions", json={"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", field: value}}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (f"tools[0].function.{field}", "invalid_type")
    assert error["message"] == f"tools[0].function.{field} must be {text}; send " \
        f"{text.split(',')[0]} or omit it.", error
    assert engine.requests == {}


def stream(client, payload) -> list[dict]:
    response = client.post("/v1/chat/completions", json={**payload, "stream": True})
    assert response.status_code == 200, response.text
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def assemble(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """Concatenate a stream as OpenAI clients do: content, tool calls by index, finish."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                slot = calls.setdefault(call["index"], {"id": None, "name": None,
                                                        "arguments": ""})
                if "id" in call:
                    assert slot["id"] is None            # the header comes once
                    slot["id"], slot["name"] = call["id"], call["function"]["name"]
                    assert call["type"] == "function"
                slot["arguments"] += call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_same_in_stream(client, payload, body):
    message = body["choices"][0]["message"]
    content, calls, finish = assemble(stream(client, payload))
    assert (content if content.strip() else None) == message["content"]   # exactly the same
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]
    assert all(c["id"].startswith("call_") for c in calls)
    assert finish == body["choices"][0]["finish_reason"]


def test_auto_parses_hermes_calls_and_streams_them():
    reply = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    client, engine = client_for(reply)
    payload = {"messages": USER, "tools": [WEATHER, TIME]}
    body = client.post("/v1/chat/completions", json=payload).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    # the text outside the tags, as the stream sends it (here a newline between the calls)
    assert choice["message"]["content"] == "Let me look.\n"
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("function", "get_weather", {"city": "Paris"}),
                                ("function", "get_time", {})]
    tag = sent_params(engine)[0].so_args           # free text; a call under its tool's schema
    assert tag["schema_type"] == "structural_tag"
    assert [t["begin"] for t in tag["schema"]["format"]["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "get_time", "arguments": ']
    assert tag["schema"]["format"]["tags"][0]["content"]["json_schema"] == WEATHER["function"][
        "parameters"]
    check_same_in_stream(client, payload, body)
    one = client.post("/v1/chat/completions",
                      json={**payload, "parallel_tool_calls": False}).json()
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1


def test_auto_without_a_call_is_plain_content_and_only_calls_give_null_content():
    client, _ = client_for("No tools needed.")
    body = client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "No tools needed.",
                                             "refusal": None, "tool_calls": None}
    client, _ = client_for('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
                           '</tool_call>')
    body = client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]}).json()
    assert body["choices"][0]["message"]["content"] is None
    # whitespace between calls is not content, in the stream as in the body
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
             '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')
    streamer = HermesStreamer(["get_weather", "get_time"])
    pieces = [p for i in range(0, len(calls), 3) for p in streamer.feed(calls[i:i + 3])]
    pieces += streamer.finish()
    assert not [p for p in pieces if "content" in p] and streamer.content is None
    assert len(streamer.calls) == 2
    client, _ = client_for(calls)
    payload = {"messages": USER, "tools": [WEATHER, TIME]}
    body = client.post("/v1/chat/completions", json=payload).json()
    assert body["choices"][0]["message"]["content"] is None
    check_same_in_stream(client, payload, body)


def test_required_constrains_to_a_call_array_and_streams_arguments():
    reply = '[{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "days": 3}}]'
    client, engine = client_for(reply)
    payload = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
               "parallel_tool_calls": False}
    body = client.post("/v1/chat/completions", json=payload).json()
    schema = sent_params(engine)[0].so_args["schema"]
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"] for b in schema["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather",
                                "arguments": '{"city": "Paris, \\"FR\\"", "days": 3}'}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    chunks = stream(client, payload)
    fragments = [c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                 for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len(fragments) > 3                           # arguments arrive as they are made
    check_same_in_stream(client, payload, body)


def test_named_function_generates_its_arguments_under_its_schema():
    client, engine = client_for('{"city": "Oslo"}')
    payload = {"messages": USER, "tools": [WEATHER, TIME],
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    body = client.post("/v1/chat/completions", json=payload).json()
    assert sent_params(engine)[0].so_args == {"schema_type": "json",
                                              "schema": WEATHER["function"]["parameters"]}
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Oslo"}'}
    assert body["choices"][0]["finish_reason"] == "stop"
    check_same_in_stream(client, payload, body)


def test_a_function_without_parameters_takes_an_empty_object():
    """Found by black-box testing: a named function with no `parameters` got made-up arguments
    (it was constrained to any object); OpenAI reads it as an empty parameter list."""
    client, engine = client_for("{}")
    noargs = {"type": "function", "function": {"name": "noargs"}}
    payload = {"messages": USER, "tools": [noargs],
               "tool_choice": {"type": "function", "function": {"name": "noargs"}}}
    body = client.post("/v1/chat/completions", json=payload).json()
    assert sent_params(engine)[0].so_args == {"schema_type": "json", "schema": {
        "type": "object", "properties": {}, "additionalProperties": False}}
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_tool_turns_go_back_through_the_template():
    client, engine = client_for()
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "22C, sunny"}]
    response = client.post("/v1/chat/completions", json={"messages": messages,
                                                         "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    prompt = engine.tokenizer.decode(next(iter(engine.requests.values()))[0])
    assert '<tools>[{"type": "function", "function": {"name": "get_weather"' in prompt
    assert ('assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in prompt
    assert "tool: <tool_response>\n22C, sunny\n</tool_response>" in prompt
    client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER],
                                              "tool_choice": "none"})
    prompt = engine.tokenizer.decode(list(engine.requests.values())[-1][0])
    assert "<tools>" not in prompt


class ToolTemplateTokenizer:
    chat_template = "{% for tool in tools %}...{% endfor %}"


def test_tool_aware_templates_get_tools_and_argument_objects():
    req = ChatCompletionRequest(messages=USER, tools=[WEATHER])
    call = {"id": "c", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    messages, kwargs = template_inputs(ToolTemplateTokenizer(), conversation, tool_config(req))
    assert kwargs == {"tools": [WEATHER]}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_text_after_a_call_streams_however_the_text_is_split():
    """Every split of a reply into three deltas (speculative decoding and a lagging stream
    send several tokens at once) streams what the whole reply parses to. A delta that opened
    the name's string, then one that closed the object and began the closing tag, once sent
    everything after the call into the call (the tag's "<" was taken for string text)."""
    text = ('Call within <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "c"}}\n</tool_call> \n\n* After the "call" text')
    whole = HermesStreamer(["get_weather"]).run(text)
    want = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    assert want[0] == 'Call within  \n\n* After the "call" text' and len(want[1]) == 1
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            streamer = HermesStreamer(["get_weather"])
            pieces = (streamer.feed(text[:i]) + streamer.feed(text[i:j])
                      + streamer.feed(text[j:]) + streamer.finish())
            content = "".join(p.get("content", "") for p in pieces) or None
            assert (content, [(c.name, c.arguments) for c in streamer.calls]) == want, (i, j)


@pytest.mark.parametrize("seed", range(5))
def test_streamers_give_the_same_calls_however_the_text_is_split(seed):
    rng = random.Random(seed)

    def run(streamer, text):
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            pieces += streamer.feed(text[i:j])
            i = j
        return pieces + streamer.finish()

    array = '[{"name": "a", "arguments": {"x": "},]\\"", "y": [1, {"z": null}]}}, ' \
            '{"name": "b", "arguments": {}}]'
    streamer = CallArrayStreamer()
    run(streamer, array)
    assert [(c.name, json.loads(c.arguments)) for c in streamer.calls] == [
        (item["name"], item["arguments"]) for item in json.loads(array)]
    assert streamer.calls[0].arguments == '{"x": "},]\\"", "y": [1, {"z": null}]}'
    hermes = 'Hi <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> <tool_c'
    streamer = HermesStreamer(["a"])
    pieces = run(streamer, hermes)
    assert "".join(p.get("content", "") for p in pieces) == "Hi  <tool_c"
    assert [(c.name, c.arguments) for c in streamer.calls] == [("a", '{"k": 1}')]
    streamer = NamedCallStreamer("a")
    run(streamer, '{"k": [1, 2]}')
    assert [(c.name, c.arguments) for c in streamer.calls] == [("a", '{"k": [1, 2]}')]


def test_a_call_array_cut_by_max_tokens_keeps_its_wrapper_out_of_content():
    """tool_choice "required" cut (max_tokens) before the first call's name is complete: no
    call and no content (the `[{"name": ...` wrapper is the grammar's, not the model's text);
    a cut inside a call's arguments keeps the call with what was generated, as a named
    function's call does."""
    cut = CallArrayStreamer().run('[{"name": "get_wea')
    assert (cut.calls, cut.content) == ([], None)
    partial = CallArrayStreamer().run('[{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in partial.calls] == [("get_weather", '{"city": "Pa')]
    assert partial.content is None


def test_choice_regex_matches_each_choice_exactly_under_xgrammar(smollm2_tokenizer):
    import re

    from deepinfer.engine.structured.xgrammar_backend import XGrammarBackend
    from deepinfer.server.structured import choice_regex

    choices = ["a-b", "c/d", "e f", "x.y*z?", "[br]{3}", "Zürich", "a|b", "back\\slash", "(p)^$"]
    regex = choice_regex(choices, "guided_choice")
    backend = XGrammarBackend(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    compiled = backend.compile(("regex", regex))

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled, [2])
        tokens = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(2)

    for choice in choices:
        assert accepts(choice) and re.fullmatch(regex, choice)
    assert not accepts("ab") and not accepts("a-b-") and not re.fullmatch(regex, "a")


def test_required_keeps_local_refs_of_nested_parameters_resolvable(smollm2_tokenizer):
    """Found by black-box testing: pydantic-style parameters with `$defs` + "#/$defs/..." refs
    (openai.pydantic_function_tool of a nested model) were a 400 under tool_choice "required",
    because the call-array wrapper moved them away from the schema root."""
    from deepinfer.engine.structured.xgrammar_backend import XGrammarBackend
    from deepinfer.server.tools import ToolConfig, tool_so_args

    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": False}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"},
                                         "tag": {"const": {"$ref": "#/kept"}}},
        "required": ["to"]}}}
    so_args = tool_so_args(ToolConfig([ship, TIME], "required", None, True))
    assert so_args["schema"]["$defs"]["__tool0"]["properties"]["tag"] == {
        "const": {"$ref": "#/kept"}}                  # values are data, not references
    backend = XGrammarBackend(smollm2_tokenizer, len(smollm2_tokenizer), [2])
    compiled = backend.compile(("json", json.dumps(so_args["schema"])))

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled, [2])
        tokens = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(2)

    assert accepts('[{"name": "ship", "arguments": {"to": {"city": "Paris"}}}]')
    assert accepts('[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert not accepts('[{"name": "ship", "arguments": {"to": {"city": 1}}}]')


def test_a_closing_tag_inside_the_arguments_keeps_the_call(caplog):
    """Issue 27.1: arguments containing `</tool_call>` (an agent writing about tool calling)
    came back as content with tool_calls null; the body is now scanned as JSON. A block that
    is not a call of the offered tools is reported: logged and sent as content, never dropped."""
    doc = 'Wrap calls in <tool_call>...</tool_call> tags, e.g. "</tool_call>".'
    reply = ('<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": {
        "city": doc}}) + '\n</tool_call>')
    client, _ = client_for(reply)
    payload = {"messages": USER, "tools": [WEATHER, TIME]}
    body = client.post("/v1/chat/completions", json=payload).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": doc}
    check_same_in_stream(client, payload, body)
    bad = '<tool_call>\nget_weather(city="Paris")\n</tool_call>'
    client, _ = client_for("Sure. " + bad)
    body = client.post("/v1/chat/completions", json=payload).json()
    assert body["choices"][0]["message"]["content"] == "Sure. " + bad
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "is not a call of the offered tools" in caplog.text
    # arguments that break after the name: not streamed, the block is content; streamed (the
    # header and fragments are out already), the call as generated, and a warning
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    client, _ = client_for(broken)
    body = client.post("/v1/chat/completions", json=payload).json()
    assert body["choices"][0]["message"]["tool_calls"] is None
    assert body["choices"][0]["message"]["content"] == broken
    assert "does not parse as a call; sent as content" in caplog.text
    streamer = HermesStreamer(["get_weather"])
    streamer.feed(broken)
    streamer.finish()
    assert [(c.name, c.arguments) for c in streamer.calls] == [("get_weather", '{"city": }\n')]
    assert "its arguments are not a JSON object" in caplog.text


def test_auto_streams_arguments_as_they_are_generated():
    """Issue 34.3: a streamed auto call sends its header once the name is complete, then its
    arguments in fragments, which concatenate to the non-streamed arguments."""
    arguments = {"city": "Paris, \"FR\"", "days": 3}
    reply = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": '
             + json.dumps(arguments) + '}\n</tool_call>')
    client, _ = client_for(reply)
    payload = {"messages": USER, "tools": [WEATHER, TIME]}
    body = client.post("/v1/chat/completions", json=payload).json()
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": json.dumps(arguments)}
    chunks = stream(client, payload)
    fragments = [c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                 for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len([f for f in fragments if f]) > 3
    check_same_in_stream(client, payload, body)


@pytest.mark.parametrize("fields, so_args", [
    ({"structured_outputs": {"json": SCHEMA, "backend": "guidance"}},
     {"schema_type": "json", "schema": SCHEMA, "backend": "guidance"}),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"backend": "xgrammar"}},
     {"schema_type": "json_object", "backend": "xgrammar"}),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"backend": "auto"}},
     "auto"),
])
def test_structured_outputs_backend_is_passed_per_request(fields, so_args):
    client, engine = client_for("{}" if "tools" not in fields else "[]")
    response = client.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert response.status_code == 200, response.text
    sent = sent_params(engine)[0].so_args
    assert (sent["backend"] == so_args) if isinstance(so_args, str) else sent == so_args
    bad = client.post("/v1/chat/completions", json={
        "messages": USER, "structured_outputs": {"json": SCHEMA, "backend": "outlines"}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "structured_outputs.backend"


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": }}',           # arguments not JSON
    '{"name": "get_weather", "arguments": [1]}',                    # not an object
    '{"name": "get_weather", "arguments": {"city": "Rome"}} junk',  # text after the call
])
def test_a_broken_block_of_a_whole_output_is_content_not_a_call(body):
    """Non-streamed, nothing was sent yet: a block whose name is an offered tool but whose
    body does not parse as a call comes back as content (README), not as a broken call."""
    text = f"<tool_call>{body}</tool_call> tail"
    streamer = HermesStreamer(["get_weather"]).run(text)
    assert streamer.calls == [] and streamer.content == text
    good = HermesStreamer(["get_weather"]).run(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in good.calls] == [
        ("get_weather", {"city": "Rome"})]


def fresh_tool(name: str) -> dict:
    """A tool whose schema no other test checked (so its validity is not cached yet)."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "description": f"{name}-{time.monotonic_ns()}",
        "properties": {"q": {"type": "string"}}}}}


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required",
                                         {"type": "function", "function": {"name": "first"}}])
def test_each_tool_schema_is_checked_once_and_then_cached(monkeypatch, tool_choice):
    """Each tool's parameters reach `check_valid` once per request, whatever the tool_choice:
    the server checks those the output is not held to, the engine's compile (standing in:
    the double's `check_valid`) the rest; a second identical request checks nothing again."""
    from deepinfer.engine import structured
    from deepinfer.engine.structured import validity
    from deepinfer.server import tools

    seen, checked = [], []
    real_check, real_problem = structured.check_valid, validity._problem

    def spy(schema):
        seen.append(json.dumps(schema))
        real_check(schema)

    monkeypatch.setattr(tools, "check_valid", spy)
    monkeypatch.setattr(structured, "check_valid", spy)    # the double's compile
    monkeypatch.setattr(validity, "_problem", lambda schema: checked.append(schema)
                        or real_problem(schema))
    first, second = fresh_tool("first"), fresh_tool("second")
    payload = {"messages": USER, "tools": [first, second], "tool_choice": tool_choice}
    client, engine = client_for('[{"name": "first", "arguments": {}}]')
    assert client.post("/v1/chat/completions", json=payload).status_code == 200
    for tool in (first, second):
        parameters = json.dumps(tool["function"]["parameters"])
        assert sum(parameters in text for text in seen) == 1, (tool_choice, seen)
    assert len(checked) == len(seen)
    assert client.post("/v1/chat/completions", json=payload).status_code == 200
    assert len(checked) == len(seen) // 2, "the second request checked a schema again"


@pytest.mark.parametrize("tool_choice", ["auto", "required",
                                         {"type": "function", "function": {"name": "bad"}}])
def test_an_invalid_tool_schema_names_its_tool_under_every_choice(tool_choice):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean", "const": None}}}}}
    client, engine = client_for()
    response = client.post("/v1/chat/completions", json={
        "messages": USER, "tools": [WEATHER, bad], "tool_choice": tool_choice})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools[1].function.parameters", error
    assert error["message"] == (
        "Invalid tools[1].function.parameters: the 'const' value null at #/properties/on "
        "fails the rest of its schema (null is not of type \"boolean\"): no output can take "
        "it; drop the value or change the other keywords to allow it. Fix it and retry.")
    assert engine.requests == {}


def test_a_slow_first_schema_check_does_not_stall_other_requests(monkeypatch):
    """The check runs in a worker thread: while it is held, a plain request is served start
    to finish on the same event loop, and only then is the check let go."""
    from deepinfer.engine.structured import validity

    started, release = threading.Event(), threading.Event()
    real = validity._problem

    def held(schema):
        started.set()
        if not release.wait(60):    # a guard against hanging, not a timing assertion
            raise AssertionError("the event loop was blocked while the schema was checked")
        return real(schema)

    monkeypatch.setattr(validity, "_problem", held)
    finished = []

    async def run():
        app = build_app(ScriptedEngine(max_model_len=4096))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            async def with_tools():
                response = await client.post("/v1/chat/completions", json={
                    "messages": USER, "tools": [fresh_tool("slow")]})
                finished.append("tools")
                return response

            async def plain():
                while not started.is_set():
                    await asyncio.sleep(0.01)
                response = await client.post("/v1/chat/completions", json={"messages": USER})
                finished.append("plain")
                release.set()
                return response

            return await asyncio.gather(with_tools(), plain())

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert finished == ["plain", "tools"]
