"""One request must never kill the engine, through AsyncLLM and the HTTP app (in-process, httpx's
ASGI transport, a tiny random Llama): a request whose step fails (a fault injected in the
forward pass) gets an OpenAI-style error — a 500 `request_failed` before its first token, an
error event in a stream already started — while the requests batched with it get exactly their
normal answers, no KV block leaks, and the server goes on serving."""

import asyncio
import json

import httpx
import pytest

from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.server.app import build_app
from tests.fault_injection import POISON, PoisonedForward
from tests.tiny_models import save_tiny_llama

NUM_BLOCKS = 256
GOOD = [[1, 2, 3], list(range(100, 120)), [7] * 9, [42, 43]]
FAIL_POSITION = 44       # past every GOOD request's last position (20 + 8 tokens)
LONG = list(range(500, 540))   # 40 tokens: fails at its 5th output token


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_tokenizer):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48))
    engine = AsyncLLM(config)
    model = engine.engine_core.executor.runner.model
    model.forward = PoisonedForward(model, fail_position=FAIL_POSITION)
    yield engine
    engine.shutdown()


def body(prompt, stream=False):
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def post_all(engine, *bodies) -> list[httpx.Response]:
    async def run():
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as client:
            return await asyncio.gather(*(
                client.post("/v1/completions", json={**b, "model": engine.model_name})
                for b in bodies))

    return asyncio.run(run())


def texts(responses) -> list[str]:
    assert [r.status_code for r in responses] == [200] * len(responses)
    return [r.json()["choices"][0]["text"] for r in responses]


def sse_events(response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def wait_idle(engine) -> None:
    async def poll():
        for _ in range(200):
            stats = engine.get_stats()
            if stats.num_running_reqs == 0 and stats.num_free_kv_blocks == NUM_BLOCKS:
                return
            await asyncio.sleep(0.02)

    asyncio.run(poll())
    core = engine.engine_core
    assert core.scheduler.kv_cache_manager.block_pool.num_free_blocks == NUM_BLOCKS
    assert not core.scheduler.requests


def test_bad_requests_get_errors_the_batch_its_normal_answers(engine):
    expected = texts(post_all(engine, *(body(p) for p in GOOD)))
    bad_prompt = [11, 12, POISON, 13]
    responses = post_all(engine, *(body(p) for p in GOOD), body(bad_prompt),
                         body(bad_prompt, stream=True), body(LONG, stream=True), body(LONG))
    assert texts(responses[:4]) == expected
    for response in responses[4:6]:   # failed before any token: an HTTP error status
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "request_failed" and error["type"] == "server_error"
        assert "injected fault in the forward pass" in error["message"]
    events = sse_events(responses[6])   # failed mid-stream: tokens, then an error event
    assert "choices" in events[0] and events[-1]["error"]["code"] == "request_failed"
    assert responses[7].status_code == 500
    assert engine.engine_core.faults.num_failed_requests == 4
    wait_idle(engine)
    engine.check_health()
    assert texts(post_all(engine, *(body(p) for p in GOOD))) == expected   # served after
