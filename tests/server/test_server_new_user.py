"""What a new user hit (issue 27, items 3, 4 and 7): completions logprobs of tokens holding part
of a UTF-8 character, an omitted max_tokens near the context's end, a chat body sent to
/v1/completions, mistyped kv_transfer_params, the drain error's advice. Pure functions, the
real SmolLM2 tokenizer, and the app over the scripted engine (fast); the same through the real
engine is in test_server_real_engine.py."""

import pytest
from fastapi.testclient import TestClient

from deepinfer.engine.errors import EngineShuttingDownError
from deepinfer.engine.outputs import TokenLogprobs
from deepinfer.server.app import build_app
from deepinfer.server.errors import from_engine_error
from deepinfer.server.logprobs import CompletionLogprobsBuilder, TokenDecoder, shown_logprobs
from deepinfer.server.protocol import CompletionRequest
from deepinfer.server.validation import completion_kwargs, fit_max_tokens
from server_doubles import ScriptedEngine


def spelled_bytes(name: str) -> bytes:
    """The bytes a completions token name stands for (`bytes:\\xNN...` or its UTF-8 text)."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode("utf-8")


# ------------------------------------------------------------------- item 3: logprobs spelling

def test_partial_character_tokens_get_distinct_byte_spellings(smollm2_tokenizer):
    decode = TokenDecoder(smollm2_tokenizer)
    emoji = smollm2_tokenizer.encode("🙂", add_special_tokens=False)
    cjk = smollm2_tokenizer.encode("東京", add_special_tokens=False)
    partial = [t for t in dict.fromkeys(emoji + cjk) if "\ufffd" in decode(t)[0]]
    assert len(partial) >= 4   # each shows as "�" alone: the collision the issue saw
    sampled = partial[1]
    top = [(t, -0.5 - i) for i, t in enumerate(partial[:4])] + [(
        smollm2_tokenizer.encode(" the", add_special_tokens=False)[0], -6.0)]
    entry = TokenLogprobs(token_id=sampled, logprob=-1.5, rank=2, top=top)
    out = CompletionLogprobsBuilder(decode).add([entry])
    names = list(out.top_logprobs[0])
    assert len(names) == 5                       # ask for 5, get 5
    assert out.top_logprobs[0][out.tokens[0]] == out.token_logprobs[0] == -1.5
    for (token_id, logprob), name in zip(top, names):
        assert spelled_bytes(name) == bytes(decode(token_id)[1])
        assert out.top_logprobs[0][name] == logprob
    assert all(name.startswith("bytes:\\x") for name in names[:4])
    assert names[4] == " the"


def test_text_offsets_follow_characters_not_tokens(smollm2_tokenizer):
    decode = TokenDecoder(smollm2_tokenizer)
    text = "a🙂東京!"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    builder = CompletionLogprobsBuilder(decode, start_offset=3)
    first = builder.add([TokenLogprobs(t, -1.0, 1, []) for t in ids[:2]])
    rest = builder.add([TokenLogprobs(t, -1.0, 1, []) for t in ids[2:]])  # a second chunk
    tokens = first.tokens + rest.tokens
    offsets = first.text_offset + rest.text_offset
    assert b"".join(spelled_bytes(t) for t in tokens) == text.encode()
    for i, offset in enumerate(offsets):
        before = b"".join(spelled_bytes(t) for t in tokens[:i])
        # a token points at the character its first byte belongs to
        assert offset == 3 + len(before.decode("utf-8", errors="ignore"))
    assert builder.offset == 3 + len(text)


class _SameText:
    """A tokenizer whose tokens 1 and 2 both read "a" (as a normalizer can make happen)."""

    def decode(self, ids, skip_special_tokens=False):
        return {1: "a", 2: "a", 3: "b"}[ids[0]]

    def convert_ids_to_tokens(self, token_id):
        return "a" if token_id != 3 else "b"


def test_two_tokens_of_one_text_stay_apart():
    entry = TokenLogprobs(token_id=2, logprob=-2.0, rank=2, top=[(1, -1.0), (2, -2.0), (3, -3.0)])
    out = CompletionLogprobsBuilder(TokenDecoder(_SameText())).add([entry])
    assert out.tokens == ["a"]
    assert out.top_logprobs[0] == {"token_id:1": -1.0, "a": -2.0, "b": -3.0}


def test_the_stop_token_is_left_out_only_for_token_stops():
    entries = [TokenLogprobs(t, -1.0, 1, []) for t in (5, 6, 2)]
    assert shown_logprobs(entries, "stop", None) == entries[:2]        # EOS
    assert shown_logprobs(entries, "stop", 2) == entries[:2]           # a stop_token_id
    assert shown_logprobs(entries, "stop", "END") == entries           # a stop string: text cut
    assert shown_logprobs(entries, "length", None) == entries
    assert shown_logprobs(entries, None, None) == entries              # still running
    assert shown_logprobs([], "stop", None) == []


# ----------------------------------------------------------- item 4: an omitted max_tokens

def test_omitted_max_tokens_is_not_a_requested_16():
    kwargs, asked = completion_kwargs(CompletionRequest(prompt="x"))
    assert asked is None
    assert fit_max_tokens(asked, 10, 64, default=16) == 16
    assert fit_max_tokens(asked, 60, 64, default=16) == 4    # cut to the room left
    assert fit_max_tokens(asked, 60, 64) == 4                # chat: up to the window


@pytest.fixture
def engine():
    return ScriptedEngine(max_model_len=64)


@pytest.fixture
def client(engine):
    return TestClient(build_app(engine), raise_server_exceptions=False)


def test_completions_near_the_context_end_without_max_tokens(client, engine):
    prompt = "p" * 55     # 56 tokens with the BOS: 8 left, fewer than the default 16
    response = client.post("/v1/completions", json={"prompt": prompt})
    assert response.status_code == 200, response.text
    (_, params), = engine.requests.values()
    assert params.max_tokens == 8
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("max_tokens=16 plus 56 prompt tokens")
    client.post("/v1/completions", json={"prompt": "short"})
    assert list(engine.requests.values())[-1][1].max_tokens == 16


# --------------------------------------------------------------------------- item 7: smaller

def test_messages_sent_to_completions_points_to_chat(client):
    response = client.post("/v1/completions",
                           json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "/v1/chat/completions" in error["message"]
    response = client.post("/v1/completions", json={"max_tokens": 3})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "missing_required_parameter")


def test_an_empty_content_array_is_400(client):
    """OpenAI answers an empty parts array with a 400 ("expected at least 1"), as a missing
    content; it must not reach the model as an empty turn."""
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": []}], "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("messages[0].content") and "at least 1" in error["message"]


@pytest.mark.parametrize("params, named", [
    ({"do_remote_prefill": True, "num_stored_tokens": "lots"}, 'num_stored_tokens="lots"'),
    ({"do_remote_prefill": True, "num_stored_tokens": -16}, "num_stored_tokens=-16"),
    ({"do_remote_prefill": True, "block_size": 0}, "block_size=0"),
    ({"do_remote_prefill": True, "block_size": 1.5}, "block_size=1.5"),
    ({"do_remote_prefill": True, "model_fingerprint": 7}, "model_fingerprint=7"),
    ({"do_remote_prefill": "yes"}, 'do_remote_prefill="yes" must be true or false'),
])
def test_malformed_kv_transfer_params_are_400(client, params, named):
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}]})):
        response = client.post(path, json={**extra, "max_tokens": 2,
                                           "kv_transfer_params": params})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("kv_transfer_params", "invalid_type")
        assert f"kv_transfer_params.{named}" in error["message"]


def test_well_formed_kv_transfer_params_pass(client):
    handoff = {"do_remote_prefill": True, "num_stored_tokens": 16, "block_size": 16,
               "model_fingerprint": "ab12", "remote_engine_id": "a vLLM connector's key"}
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                    "kv_transfer_params": handoff})
    assert response.status_code == 200, response.text


def test_drain_error_does_not_promise_another_replica():
    error = from_engine_error(EngineShuttingDownError("its drain time of 5 s passed."))
    assert error.status_code == 503 and error.code == "server_shutting_down"
    assert "another replica will take it" not in error.message
    assert "Retry" in error.message
