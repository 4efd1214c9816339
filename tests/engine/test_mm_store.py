"""Image embeddings through the KV store (a private redis-server): an encoder-only worker stores
them, a `both` worker loads them instead of encoding and answers the same tokens; a corrupted
stored embedding is detected (checksum) and encoded again; the store stopped changes nothing but
speed."""

import pytest

from deepinfer.engine.config import (CacheConfig, EngineConfig, KVTransferConfig, ModelConfig,
                                     SchedulerConfig)
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.mm_worker import EncoderWorker
from deepinfer.engine.sampling_params import SamplingParams
from tests.tiny_models import png_bytes, save_tiny_idefics3

pytestmark = pytest.mark.usefixtures("torch_single_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXT = "User:<image>Tell me.<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3-store"), smollm2_tokenizer)


def config(vlm_dir, kv_store="memory", role="both"):
    return EngineConfig(model=ModelConfig(model=str(vlm_dir), dtype="float32", device="cpu"),
                        cache=CacheConfig(block_size=16, num_blocks=64),
                        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
                        kv_transfer=KVTransferConfig(role=role, kv_store=kv_store,
                                                     timeout_s=0.5))


def generate(core, image: bytes, request_id: str) -> list[int]:
    processed = [core.mm_processor.process_image(image)]
    ids = core.tokenizer.encode(core.mm_processor.expand(TEXT, processed))
    request = core.make_request(ids, GREEDY, request_id,
                                mm_inputs=core.mm_processor.place(ids, processed))
    core.add_request(request)
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                result = out.token_ids
    return result


def test_encoder_worker_embeddings_are_loaded_and_corruption_is_recomputed(vlm_dir,
                                                                            redis_server):
    image, corrupt_image = png_bytes(70, 50, seed=21), png_bytes(50, 70, seed=22)
    local = EngineCore(config(vlm_dir))    # monolithic reference, no shared store
    reference = [generate(local, image, "a"), generate(local, corrupt_image, "b")]
    local.close()

    encoder = EncoderWorker(config(vlm_dir, redis_server.url, role="encoder"))
    processed = [encoder.mm_processor.process_image(d) for d in (image, corrupt_image)]
    assert [r["stored"] for r in encoder.encode_and_store(processed)] == [True, True]
    assert encoder.get_stats().images_encoded == 2
    # flip one payload byte of the second image's stored embedding: its CRC no longer holds
    store = encoder.embedder.store
    key = store.key(processed[1].image.content_hash)
    value = bytearray(store._run(store.store.get_many([key]))[0])
    value[-5] ^= 0xFF
    store._run(store.store.put_many({key: bytes(value)}))
    encoder.shutdown()

    core = EngineCore(config(vlm_dir, redis_server.url))
    try:
        assert generate(core, image, "c") == reference[0]
        stats = core.get_stats().mm_encoder
        assert (stats.store_hits, stats.images_encoded) == (1, 0)   # loaded, not encoded
        assert generate(core, corrupt_image, "d") == reference[1]
        stats = core.get_stats().mm_encoder
        assert (stats.store_corrupt, stats.images_encoded) == (1, 1)   # detected, re-encoded
        redis_server.stop()   # the store down: encoded locally, same answer
        core.scheduler.kv_cache_manager.reset_prefix_cache()
        core.executor.runner.mm.cache = type(core.executor.runner.mm.cache)(1 << 20)
        assert generate(core, image, "e") == reference[0]
        assert core.get_stats().mm_encoder.images_encoded == 2
    finally:
        core.close()


def test_encoder_endpoint_needs_the_key_and_names_bad_parts(vlm_dir, redis_server):
    import asyncio
    import base64

    import httpx

    from deepinfer.server.encoder_app import build_encoder_app

    worker = EncoderWorker(config(vlm_dir, redis_server.url, role="encoder"))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(30, 30, seed=5)).decode()
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    bad = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}

    async def calls():
        app = build_encoder_app(worker, api_key="k")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            auth = {"Authorization": "Bearer k"}
            return (await client.post("/v1/encode", json=body),
                    await client.post("/v1/encode", json=body, headers=auth),
                    await client.post("/v1/encode", json=bad, headers=auth),
                    (await client.get("/metrics")).text)

    try:
        refused, done, invalid, metrics = asyncio.run(calls())
    finally:
        worker.shutdown()
    assert refused.status_code == 401
    assert done.status_code == 200 and done.json()["images"][0]["stored"] is True
    assert invalid.status_code == 400
    assert invalid.json()["error"]["param"] == "messages[0].content[0]"
    assert "deepinfer:mm_encoder_images_encoded_total" in metrics


def test_an_image_encoded_locally_is_saved_for_the_next_worker(vlm_dir, redis_server):
    """No encoder worker: the first `both` worker encodes the image itself and writes the
    embedding to the store in the background; a second worker loads it instead of encoding."""
    image = png_bytes(40, 60, seed=23)
    first = EngineCore(config(vlm_dir, redis_server.url))
    try:
        reference = generate(first, image, "a")
        first.executor.runner.mm.store.flush()
        stats = first.get_stats().mm_encoder
        assert (stats.images_encoded, stats.store_misses, stats.store_saves) == (1, 1, 1)
    finally:
        first.close()
    second = EngineCore(config(vlm_dir, redis_server.url))
    try:
        assert generate(second, image, "b") == reference
        stats = second.get_stats().mm_encoder
        assert (stats.store_hits, stats.images_encoded, stats.store_saves) == (1, 0, 0)
    finally:
        second.close()
