"""The app in-process on the real AsyncLLM (embedded SmolLM2) through httpx's ASGI transport:
the real tokenizer's chat template and bytes, stop strings, the context window, queue full."""

import asyncio
import json

import httpx
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
