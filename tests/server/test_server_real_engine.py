"""The app in-process on the real AsyncLLM (embedded SmolLM2) through httpx's ASGI transport:
the real tokenizer's chat template and bytes, stop strings, the context window, queue full."""

import asyncio

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
