"""`kv_transfer_params` through the HTTP API: a prefill worker hands a prompt's KV to a decode
worker over a private Redis, and the decode worker answers exactly as one monolithic server.
Real AsyncLLMs on a tiny random Llama, in-process through httpx's ASGI transport (the prefill
and decode workers' engine cores in their own processes, the monolithic one's on a thread)."""

import asyncio

import httpx
import pytest

from deepinfer.engine.config import (CacheConfig, EngineConfig, FrontendConfig, KVTransferConfig,
                                     ModelConfig, SchedulerConfig)
from deepinfer.server.app import build_app
from tests.tiny_models import save_tiny_llama

MESSAGES = [{"role": "user", "content": "Tell me a story about a block store. " * 4}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-server"), smollm2_tokenizer)


def engine(model_dir, role: str, kv_store: str, engine_process: bool = False):
    from deepinfer.engine.async_llm import AsyncLLM

    return AsyncLLM(EngineConfig(frontend=FrontendConfig(engine_process=engine_process),
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=8, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        kv_transfer=KVTransferConfig(role=role, kv_store=kv_store, timeout_s=1.0)))


@pytest.fixture(scope="module")
def workers(tiny_dir, redis_url):
    started = {"mono": engine(tiny_dir, "both", "none"),
               # the hand-off also crosses engine core processes (engine/core_client.py)
               "prefill": engine(tiny_dir, "prefill", redis_url, engine_process=True),
               "decode": engine(tiny_dir, "decode", redis_url, engine_process=True)}
    yield started
    for llm in started.values():
        llm.shutdown()


def call(llm, path: str, body: dict, method: str = "post") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=build_app(llm))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as client:
            if method == "get":
                return await client.get(path)
            return await client.post(path, json=body)

    return asyncio.run(go())


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10, "temperature": 0}),
    ("/v1/completions", {"prompt": "Once upon a time there was a cache " * 5, "max_tokens": 10,
                         "temperature": 0}),
])
def test_prefill_then_decode_equals_one_server(workers, path, body):
    reference = call(workers["mono"], path, body).json()
    prefill = call(workers["prefill"], path, {**body, "max_tokens": 1, "stream": False,
                                              "kv_transfer_params": {"do_remote_decode": True}})
    assert prefill.status_code == 200, prefill.text
    handoff = prefill.json()["kv_transfer_params"]
    prompt_tokens = reference["usage"]["prompt_tokens"]
    assert handoff["do_remote_prefill"] is True and handoff["block_size"] == 8
    assert handoff["num_stored_tokens"] == prompt_tokens // 8 * 8
    assert len(handoff["model_fingerprint"]) == 16

    decoded = call(workers["decode"], path, {**body, "kv_transfer_params": handoff}).json()
    text = (lambda r: r["choices"][0].get("message", {}).get("content")
            or r["choices"][0].get("text"))
    assert text(decoded) == text(reference)
    assert decoded["usage"] == {**reference["usage"], "prompt_tokens_details": {
        "cached_tokens": (prompt_tokens - 1) // 8 * 8}}
    assert reference["kv_transfer_params"] is None


def test_handoff_needs_one_choice_and_no_stream(workers):
    body = {"messages": MESSAGES, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    for extra in ({"n": 2}, {"stream": True}):
        response = call(workers["prefill"], "/v1/chat/completions", {**body, **extra})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "kv_transfer_params"
    # a string is not a flag: "false" must not start a hand-off
    for flags in ({"do_remote_decode": "false"}, {"do_remote_prefill": 1}):
        response = call(workers["prefill"], "/v1/chat/completions",
                        {**body, "kv_transfer_params": flags})
        assert response.status_code == 400
        assert "must be true or false" in response.json()["error"]["message"]


def test_kv_store_metrics_are_exported(workers):
    body = {"prompt": "Metrics count the blocks a decode worker loads. " * 3, "max_tokens": 2}
    call(workers["prefill"], "/v1/completions",
         {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    call(workers["decode"], "/v1/completions", body)
    text = call(workers["decode"], "/metrics", {}, method="get").text
    for name in ("kv_store_hits_total", "kv_store_misses_total", "kv_store_loaded_bytes_total",
                 "kv_store_saved_bytes_total", "kv_store_errors_total",
                 "kv_store_load_latency_seconds_bucket", "kv_store_save_latency_seconds_count"):
        assert f"deepinfer:{name}" in text
    hits = next(line for line in text.splitlines()
                if line.startswith("deepinfer:kv_store_hits_total"))
    assert float(hits.split()[-1]) > 0
    assert "kv_store" not in call(workers["mono"], "/metrics", {}, method="get").text


def test_cli_flags_and_environment_map_to_kv_transfer_config():
    from deepinfer.server.cli import build_engine_config, build_parser

    args = build_parser().parse_args(["serve", "--role", "prefill", "--kv-store",
                                      "rediss://:pw@cache:6380/2", "--kv-store-ttl-s", "60"])
    config = build_engine_config(args, {"DEEPINFER_KV_ROLE": "decode",
                                        "DEEPINFER_KV_STORE_TIMEOUT_S": "0.25"}).kv_transfer
    assert (config.role, config.kv_store, config.ttl_s, config.timeout_s) == (
        "prefill", "rediss://:pw@cache:6380/2", 60, 0.25)   # flags win over the environment
    default = build_engine_config(build_parser().parse_args(["serve"]), {}).kv_transfer
    assert (default.role, default.kv_store) == ("both", "memory")
    with pytest.raises(ValueError, match="through a shared store"):
        build_engine_config(build_parser().parse_args(
            ["serve", "--role", "decode", "--kv-store", "none"]), {})
    with pytest.raises(ValueError, match="not supported"):
        build_engine_config(build_parser().parse_args(["serve", "--kv-store", "s3://x"]), {})
    with pytest.raises(ValueError, match="kv_store=memory is not one"):   # nothing would cross
        build_engine_config(build_parser().parse_args(["serve", "--role", "prefill"]), {})


def test_decode_reports_what_the_clients_prompt_hit_not_the_handoff(workers):
    """Issue 26.7: in disaggregated mode the decode worker's hits include the prefill's
    hand-off, so cached_tokens said the whole prompt was cached on a cold prompt. With the
    router's `prompt_cached_tokens` (the prefill's own cached_tokens) the client sees that."""
    body = {"prompt": "A cold prompt that nobody sent before, about handoffs " * 4,
            "max_tokens": 4, "temperature": 0}
    prefill = call(workers["prefill"], "/v1/completions",
                   {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert prefill.status_code == 200, prefill.text
    assert prefill.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    handoff = prefill.json()["kv_transfer_params"]
    plain = call(workers["decode"], "/v1/completions", {**body, "kv_transfer_params": handoff})
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # the hand-off
    reported = call(workers["decode"], "/v1/completions", {
        **body, "kv_transfer_params": {**handoff, "prompt_cached_tokens": 0}})
    assert reported.status_code == 200, reported.text
    assert reported.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert reported.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
