"""Images: TTFT with the embedding in the store vs encoded cold, and the three-way split's rate.

    python benchmarks/bench_vision.py [--model DIR] [--shape smolvlm-256m|tiny]
        [--longest-edge 1024] [--requests 24] [--concurrency 4] [--skip-split]

No VLM weights can be downloaded on these machines: by default the model is a random-weight
Idefics3 of SmolVLM-256M-Instruct's shape (SigLIP-B/16 at 512 px, 12 layers; pixel shuffle 4 ->
64 tokens per tile; a 30-layer SmolLM2-135M-shaped text model), saved in HF format with a real
Idefics3 image processor (longest edge resized to 1024 px, where SmolVLM's own uses 2048, to
keep a CPU run short); `--model DIR` serves a real HF directory instead (SmolVLM-256M).
Speed does not depend on the weights' values.

1. TTFT (one `EngineCore`, a private redis-server): one image request (`--longest-edge` px:
   1024 -> 2x2 tiles + the global image = 320 image tokens), max_tokens=1. Cold: nothing cached,
   the worker encodes the image and prefills. Store hit: an `EncoderWorker` (the `--role
   encoder` worker's core) stored the embedding first; the worker's prefix cache and encoder
   cache are dropped, so it loads the embedding from Redis and prefills. Prints both, the
   encode time alone, and hit / cold.
2. Requests/s on a mixed load (half image, half text-only requests, greedy, 16 output tokens,
   `--concurrency` in flight), through real processes: `deepinfer router --encoder E --prefill P
   --decode D` over Redis vs one monolithic `deepinfer serve` worker, on the tiny model (its
   cost is dominated by the HTTP hops and hand-offs the split adds). On one CPU box all
   processes share the cores: the split shows its cost here, not its gain (which is running
   the bursty, compute-bound encoder on its own accelerators).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_kvstore import start_redis  # noqa: E402


def save_random_smolvlm(path: Path, tokenizer) -> Path:
    """A random-weight Idefics3 of SmolVLM-256M-Instruct's shape (float32), HF format."""
    import copy

    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3Processor)
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)

    from tests.tiny_models import IDEFICS3_TOKENS, SMOLVLM_CHAT_TEMPLATE

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IDEFICS3_TOKENS)})
    config = Idefics3Config(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                           num_attention_heads=12, image_size=512, patch_size=16),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=False),
        scale_factor=4, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(path)
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    Idefics3Processor(Idefics3ImageProcessorPil(size={"longest_edge": 1024},
                                                max_image_size={"longest_edge": 512}),
                      tokenizer, image_seq_len=64,
                      chat_template=SMOLVLM_CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def smollm2_tokenizer():
    from deepinfer.engine.loader import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(None, None))


def make_model(args, tmp: Path) -> Path:
    if args.model:
        return Path(args.model)
    if args.shape == "tiny":
        from tests.tiny_models import save_tiny_idefics3

        return save_tiny_idefics3(tmp / "tiny-vlm", smollm2_tokenizer())
    return save_random_smolvlm(tmp / "smolvlm-256m-random", smollm2_tokenizer())


def image_bytes(edge: int, seed: int) -> bytes:
    from tests.tiny_models import png_bytes

    return png_bytes(edge, edge * 3 // 4, seed=seed)


def engine_config(model_dir: Path, kv_store: str, role: str = "both"):
    from deepinfer.engine.config import EngineConfig

    return EngineConfig().replace(
        model={"model": str(model_dir), "device": "cpu", "dtype": "float32"},
        cache={"num_blocks": 512, "block_size": 16},
        scheduler={"max_num_batched_tokens": 2048},
        kv_transfer={"kv_store": kv_store, "role": role})


def time_to_first_token(core, processed, text: str, request_id: str) -> float:
    from deepinfer.engine.sampling_params import SamplingParams

    processor = core.mm_processor
    ids = core.tokenizer.encode(processor.expand(text, processed))
    request = core.make_request(ids, SamplingParams(temperature=0.0, max_tokens=1),
                                request_id, mm_inputs=processor.place(ids, processed))
    started = time.perf_counter()
    core.add_request(request)
    while core.has_unfinished_requests():
        if any(out.new_token_ids for out in core.step()):
            elapsed = time.perf_counter() - started
            while core.has_unfinished_requests():
                core.step()
            return elapsed
    raise RuntimeError("no token")


def bench_ttft(model_dir: Path, edge: int, redis_url: str) -> None:
    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.engine.mm_encoder import EncoderCache
    from deepinfer.engine.mm_worker import EncoderWorker

    text = "User:<image>Describe this image.<end_of_utterance>\nAssistant:"
    core = EngineCore(engine_config(model_dir, redis_url))
    encoder = EncoderWorker(engine_config(model_dir, redis_url, role="encoder"))
    embedder = core.executor.runner.mm
    try:
        results = {}
        for name, seed in (("cold", 1), ("store hit", 2)):
            processed = [core.mm_processor.process_image(image_bytes(edge, seed))]
            if name == "store hit":
                started = time.perf_counter()
                encoder.encode_and_store(processed)
                results["encode + store (encoder worker)"] = time.perf_counter() - started
            core.scheduler.kv_cache_manager.reset_prefix_cache()
            embedder.cache = EncoderCache(embedder.cache.max_bytes)
            results[name] = time_to_first_token(core, processed, text, name)
        num_tokens = processed[0].image.num_embeds
        print(f"TTFT, one {edge}px image ({num_tokens} image tokens), CPU "
              f"({os.cpu_count()} cores), float32:")
        for name, seconds in results.items():
            print(f"  {name:34s} {seconds * 1000:9.1f} ms")
        print(f"  store hit / cold                   {results['store hit'] / results['cold']:9.2f}")
        stats = core.get_stats().mm_encoder
        print(f"  worker: encoded {stats.images_encoded}, store hits {stats.store_hits}")
    finally:
        encoder.shutdown()
        core.close()


async def _load(url: str, bodies: list[dict], concurrency: int) -> float:
    import httpx

    queue = list(bodies)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker():
            while queue:
                body = queue.pop()
                reply = await client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text

        await worker_warmup(client, bodies[0])
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


async def worker_warmup(client, body: dict) -> None:
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text


def mixed_bodies(n: int, edge: int) -> list[dict]:
    bodies = []
    for i in range(n):
        content: list | str = f"Tell me a short story about number {i}."
        if i % 2 == 0:
            url = "data:image/png;base64," + base64.b64encode(image_bytes(edge, 100 + i)).decode()
            content = [{"type": "image_url", "image_url": {"url": url}},
                       {"type": "text", "text": "What is in this image?"}]
        bodies.append({"model": "vlm", "temperature": 0, "max_tokens": 16, "ignore_eos": True,
                       "messages": [{"role": "user", "content": content}]})
    return bodies


def bench_split(model_dir: Path, redis_url: str, requests: int, concurrency: int,
                edge: int, tmp: Path) -> None:
    from tests.processes import ServerProcess, deepinfer

    common = ["serve", str(model_dir), "--served-model-name", "vlm", "--dtype", "float32",
              "--num-kv-blocks", "512", "--block-size", "16", "--log-level", "warning"]
    env = {"OMP_NUM_THREADS": "1"}
    bodies = mixed_bodies(requests, edge)
    procs = []
    try:
        mono = ServerProcess("mono", deepinfer(*common), tmp / "mono.log", env)
        procs.append(mono)
        mono.wait_ready(600)
        mono_s = asyncio.run(_load(mono.url, bodies, concurrency))
        mono.kill()
        split = {role: ServerProcess(role, deepinfer(*common, "--role", role, "--kv-store",
                                                     redis_url), tmp / f"{role}.log", env)
                 for role in ("encoder", "prefill", "decode")}
        procs += split.values()
        for proc in split.values():
            proc.wait_ready(600)
        router = ServerProcess("router", deepinfer(
            "router", "--encoder", split["encoder"].url, "--prefill", split["prefill"].url,
            "--decode", split["decode"].url, "--log-level", "warning"), tmp / "router.log",
            env)
        procs.append(router)
        router.wait_ready(60)
        split_s = asyncio.run(_load(router.url, mixed_bodies(requests, edge + 2), concurrency))
        print(f"Mixed load: {requests} requests (half with one {edge}px image), "
              f"{concurrency} in flight, 16 output tokens, one CPU box ({os.cpu_count()} "
              "cores) shared by all processes:")
        print(f"  monolithic worker                  {requests / mono_s:7.2f} req/s")
        print(f"  router: encoder->prefill->decode   {requests / split_s:7.2f} req/s")
        print(f"  split / monolithic                 {mono_s / split_s:7.2f}")
    finally:
        for proc in procs:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="an HF Idefics3/SmolVLM directory (default: random)")
    parser.add_argument("--shape", choices=["smolvlm-256m", "tiny"], default="smolvlm-256m",
                        help="random model shape for the TTFT part (%(default)s)")
    parser.add_argument("--longest-edge", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    redis = None
    if args.redis_url is None:
        redis, args.redis_url = start_redis()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            bench_ttft(make_model(args, tmp), args.longest_edge, args.redis_url)
            if not args.skip_split:
                from tests.tiny_models import save_tiny_idefics3

                tiny = save_tiny_idefics3(tmp / "tiny-split", smollm2_tokenizer())
                bench_split(tiny, args.redis_url, args.requests, args.concurrency, 96, tmp)
    finally:
        if redis is not None:
            redis.kill()


if __name__ == "__main__":
    main()
