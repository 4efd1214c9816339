"""Vision-encoder / prefill / decode disaggregation, as processes: `deepinfer router --encoder E
--prefill P --decode D` over a private redis-server, serving a tiny random Idefics3 (no VLM
weights can be downloaded here), against one monolithic worker (in-process, the reference).

One combined test (process start-up dominates its cost): image requests give the monolithic
text, streamed and not; the encoder encodes each distinct image once and the prefill worker
loads it from the store instead of encoding; text-only requests skip the encoder; with the
encoder killed, requests still answer the same (the prefill worker encodes itself).
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

from tests.conftest import RedisServer
from tests.processes import ServerProcess, deepinfer, metric
from tests.tiny_models import png_bytes, save_tiny_idefics3

pytestmark = pytest.mark.slow
MODEL = "tiny-vlm"


def start(name, args, tmp) -> ServerProcess:
    return ServerProcess(name, deepinfer(*args), tmp / f"{name}.log",
                         env={"OMP_NUM_THREADS": "1"})


def image_body(png: bytes, **extra) -> dict:
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    return {"model": MODEL, "temperature": 0, "max_tokens": 6, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "Describe it."}]}], **extra}


def reference_texts(model_dir, bodies) -> list[str]:
    """The monolithic answers: one in-process worker (AsyncLLM + the app over ASGI)."""
    from deepinfer.engine.async_llm import AsyncLLM
    from deepinfer.engine.config import EngineConfig
    from deepinfer.server.app import build_app

    llm = AsyncLLM(EngineConfig().replace(
        model={"model": str(model_dir), "device": "cpu", "dtype": "float32",
               "served_model_name": MODEL}, cache={"num_blocks": 128, "block_size": 16}))

    async def run():
        transport = httpx.ASGITransport(app=build_app(llm))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as client:
            return [(await client.post("/v1/chat/completions", json=b)).json()
                    for b in bodies]

    try:
        return [r["choices"][0]["message"]["content"] for r in asyncio.run(run())]
    finally:
        llm.shutdown()


def streamed_text(url: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: "):])
        if chunk["choices"]:
            text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def test_encoder_prefill_decode_split_equals_one_worker(tmp_path, smollm2_tokenizer):
    model_dir = save_tiny_idefics3(tmp_path / "vlm", smollm2_tokenizer)
    images = [png_bytes(80, 60, seed=31), png_bytes(40, 90, seed=32)]
    text_only = {"model": MODEL, "temperature": 0, "max_tokens": 6,
                 "messages": [{"role": "user", "content": "Hello there"}]}
    bodies = [image_body(images[0]), image_body(images[1]), text_only]
    procs: dict[str, ServerProcess] = {}
    redis = RedisServer().start()
    try:
        common = ["serve", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                  "--num-kv-blocks", "128", "--block-size", "16", "--kv-store", redis.url]
        for role in ("encoder", "prefill", "decode"):
            procs[role] = start(role, [*common, "--role", role], tmp_path)
        expected = reference_texts(model_dir, bodies)   # meanwhile, the workers start
        for proc in procs.values():
            proc.wait_ready(300)
        procs["router"] = start("router", [
            "router", "--encoder", procs["encoder"].url, "--prefill", procs["prefill"].url,
            "--decode", procs["decode"].url, "--health-interval-s", "0.5",
            "--log-level", "warning"], tmp_path).wait_ready(60)
        router = procs["router"].url

        got = httpx.post(router + "/v1/chat/completions", json=bodies[0], timeout=120)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["content"] == expected[0]
        assert streamed_text(router, bodies[0]) == expected[0]
        assert metric(procs["encoder"].url, "deepinfer:mm_encoder_images_encoded_total") == 1
        assert metric(procs["prefill"].url, "deepinfer:mm_encoder_images_encoded_total") == 0
        assert metric(procs["prefill"].url, "deepinfer:mm_encoder_store_hits_total") >= 1
        text = httpx.post(router + "/v1/chat/completions", json=bodies[2], timeout=120)
        assert text.json()["choices"][0]["message"]["content"] == expected[2]
        assert metric(router, "deepinfer_router:encoder_steps_total", outcome="ok") == 2

        procs["encoder"].kill()    # any encoder failure: the prefill worker encodes itself
        assert streamed_text(router, bodies[1]) == expected[1]
        assert metric(router, "deepinfer_router:encoder_steps_total", outcome="failed") == 1
        assert metric(procs["prefill"].url, "deepinfer:mm_encoder_images_encoded_total") == 1
    finally:
        for proc in procs.values():
            proc.kill()
        redis.stop()
