"""Every number of a request at the edges of what the engine can represent, through the real
app on the real engine (embedded SmolLM2): each is a 400 naming the field, the value and the
allowed range, and the engine still serves afterwards (issue 26.1: `top_k` = 2**63 used to pass
validation and kill the step loop for everyone)."""

import asyncio
import json

import httpx
import pytest

from deepinfer.engine.config import EngineConfig
from deepinfer.server.app import build_app

pytestmark = pytest.mark.slow

CHAT = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, %s}'
COMPLETION = '{"prompt": "Hi", "max_tokens": 2, %s}'
BIG = str(2**63)
NEG = str(-(2**63) - 1)
I32 = str(2**31)

# (template, JSON fragment, the param the 400 names, text its message holds)
EDGES = [
    (CHAT, f'"top_k": {BIG}', "top_k", BIG),
    (CHAT, f'"top_k": {NEG}', "top_k", NEG),
    (CHAT, f'"top_k": {I32}', "top_k", I32),
    (CHAT, f'"n": {BIG}', "n", BIG),
    (CHAT, f'"seed": {2**64}', "seed", str(2**64)),
    (CHAT, f'"seed": {NEG}', "seed", NEG),
    (CHAT, f'"seq_seed": {2**64}', "seq_seed", str(2**64)),
    (CHAT, f'"min_tokens": {BIG}', "min_tokens", BIG),
    (CHAT, f'"min_tokens": {NEG}', "min_tokens", NEG),
    (CHAT, f'"max_completion_tokens": {BIG}', "max_completion_tokens", BIG),
    (CHAT, f'"top_logprobs": {BIG}, "logprobs": true', "top_logprobs", BIG),
    (CHAT, f'"stop_token_ids": [2, {BIG}]', "stop_token_ids[1]", BIG),
    (CHAT, f'"stop_token_ids": [{I32}]', "stop_token_ids[0]", I32),
    (CHAT, '"temperature": NaN', "temperature", "nan"),
    (CHAT, '"temperature": Infinity', "temperature", "inf"),
    (CHAT, '"temperature": 1e309', "temperature", "inf"),
    (CHAT, '"top_p": NaN', "top_p", "nan"),
    (CHAT, '"min_p": NaN', "min_p", "nan"),
    (CHAT, '"min_p": 1e309', "min_p", "inf"),
    (CHAT, '"repetition_penalty": NaN', "repetition_penalty", "nan"),
    (CHAT, '"repetition_penalty": 1e309', "repetition_penalty", "inf"),
    (CHAT, '"presence_penalty": NaN', "presence_penalty", "nan"),
    (CHAT, '"frequency_penalty": -Infinity', "frequency_penalty", "-inf"),
    (CHAT, '"logit_bias": {"5": NaN}', "logit_bias.5", "nan"),
    (CHAT, '"logit_bias": {"5": 1e309}', "logit_bias.5", "inf"),
    (COMPLETION, f'"top_k": {BIG}', "top_k", BIG),
    (COMPLETION, f'"max_tokens": 3, "logprobs": {BIG}', "logprobs", BIG),
    (COMPLETION, f'"best_of": {BIG}', "best_of", BIG),
    (COMPLETION, f'"n": {I32}', "n", I32),
    (COMPLETION, f'"seed": {NEG}', "seed", NEG),
    (COMPLETION, f'"max_tokens": {BIG}', "max_tokens", BIG),
    (COMPLETION, f'"min_p": -1e309', "min_p", "-inf"),
]


@pytest.fixture(scope="module")
def engine():
    from deepinfer.engine.async_llm import AsyncLLM

    config = EngineConfig().replace(model={"max_model_len": 256, "device": "cpu"},
                                    scheduler={"max_num_seqs": 4})
    llm = AsyncLLM(config)
    yield llm
    llm.shutdown()


def post_raw(engine, bodies: list[tuple[str, str]]) -> list[httpx.Response]:
    """POST each (path, raw JSON text) in order, through the ASGI app."""
    async def run():
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as client:
            return [await client.post(path, content=body,
                                      headers={"content-type": "application/json"})
                    for path, body in bodies]

    return asyncio.run(run())


def path_of(template: str) -> str:
    return "/v1/chat/completions" if template is CHAT else "/v1/completions"


def test_every_edge_is_a_400_naming_field_value_and_range_and_the_engine_lives(engine):
    bodies = [(path_of(t), t % fragment) for t, fragment, _, _ in EDGES]
    bodies.append(("/v1/chat/completions", CHAT % '"temperature": 0'))
    *refused, served = post_raw(engine, bodies)
    for (_, fragment, param, text), reply in zip(EDGES, refused):
        assert reply.status_code == 400, (fragment, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param, (fragment, error)
        assert text in error["message"], (fragment, error)
        assert "outside" in error["message"] or "finite" in error["message"], error
        assert error["code"] == "invalid_value", error
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 2
    engine.check_health()


def test_edges_within_range_are_served(engine):
    """The largest values the checks allow run (top_k past the vocabulary is top_k off; a
    stop token id past the vocabulary is refused by the server's vocabulary check, not here)."""
    bodies = [("/v1/chat/completions", CHAT % f'"top_k": {2**31 - 1}, "seed": {2**64 - 1}'),
              ("/v1/chat/completions", CHAT % f'"seed": {-(2**63)}, "temperature": 2.0'),
              ("/v1/completions", COMPLETION % '"min_p": 1.0, "repetition_penalty": 100.0')]
    for reply in post_raw(engine, bodies):
        assert reply.status_code == 200, reply.text
        assert json.loads(reply.text)["usage"]["completion_tokens"] >= 1


def test_a_negative_seed_wraps_modulo_2_64(engine):
    """Seeds are taken in [-2**63, 2**64 - 1] (vLLM takes int64 seeds) and sample modulo 2**64:
    seed -1 gives the tokens of seed 2**64 - 1, and another seed other tokens."""
    body = '{"prompt": "Hi", "temperature": 1.0, "max_tokens": 12, "seed": %d}'
    replies = post_raw(engine, [("/v1/completions", body % seed)
                                for seed in (-1, 2**64 - 1, 2**64 - 2)])
    texts = [reply.json()["choices"][0]["text"] for reply in replies]
    assert all(reply.status_code == 200 for reply in replies), replies[0].text
    assert texts[0] == texts[1] != texts[2], texts
