"""KV block store: time to first token loaded from Redis vs a cold prefill, and store goodput.

    python benchmarks/bench_kvstore.py [--model PATH] [--prompt-tokens 2000] [--redis-url URL]

Starts a private `redis-server` (no persistence) on a free port unless --redis-url is given.

1. TTFT: one engine (the real SmolLM2 by default, float32 KV, block size 16) with the Redis
   store. A ~2,000-token prompt, max_tokens=1: first cold (empty store, empty local cache; the
   prefill computes every token and saves its blocks), then, after the saves have landed and
   the local prefix cache is dropped, again: the blocks are loaded from Redis and only the last
   block is computed. TTFT = add_request to the first token, on the engine's own step loop.
   Prints both, and the ratio hit / cold (target <= 0.3).
2. Goodput: the same prompt's KV blocks (real size) saved and loaded by `KVTransfer` (encode +
   CRC-32 + pipelined SET; MGET + verify + decode into one tensor) vs plain redis-py asyncio
   pipelined SET / MGET of values of the same size; MB/s = payload bytes / wall time, best of
   --repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


def ttft(core, prompt_ids: list[int], request_id: str) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the prompt tokens served from cache."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = core.make_request(prompt_ids, params, request_id)
    started = time.perf_counter()
    core.add_request(request)
    while True:
        for out in core.step():
            if out.new_token_ids:
                elapsed = time.perf_counter() - started
                while core.has_unfinished_requests():
                    core.step()
                return elapsed, out.num_cached_tokens


def measure_ttft(core, prompt_ids: list[int]) -> tuple[float, float, int]:
    core.scheduler.kv_cache_manager.reset_prefix_cache()
    cold_s, cold_cached = ttft(core, prompt_ids, "cold")
    assert cold_cached == 0, f"the cold run found {cold_cached} tokens cached"
    core.kv_transfer.flush()
    core.scheduler.kv_cache_manager.reset_prefix_cache()
    hit_s, cached = ttft(core, prompt_ids, "hit")
    return cold_s, hit_s, cached


def measure_goodput(core, url: str, num_blocks: int, repeats: int) -> dict[str, float]:
    """MB/s of KVTransfer saves/loads vs plain redis-py SET/MGET, same value sizes."""
    import numpy as np
    import redis.asyncio as redis_asyncio

    transfer = core.kv_transfer
    blocks = core.executor.runner.read_kv_blocks(list(range(num_blocks)))
    payload_bytes = blocks.numel() * blocks.element_size()
    block_bytes = payload_bytes // num_blocks
    best = {"ours_save": 0.0, "ours_load": 0.0, "redis_set": 0.0, "redis_get": 0.0}
    for repeat in range(repeats):
        hashes = [(repeat << 32) + i for i in range(num_blocks)]
        started = time.perf_counter()
        assert transfer._submit(transfer._put(hashes, blocks)).result()
        best["ours_save"] = max(best["ours_save"], payload_bytes / (time.perf_counter() - started))
        started = time.perf_counter()
        loaded = transfer._submit(transfer._fetch(hashes)).result()
        best["ours_load"] = max(best["ours_load"], payload_bytes / (time.perf_counter() - started))
        assert loaded.shape[0] == num_blocks

    values = [np.random.default_rng(i).bytes(block_bytes) for i in range(num_blocks)]

    async def plain() -> None:
        client = redis_asyncio.Redis.from_url(url)
        for repeat in range(repeats):
            keys = [f"bench:{repeat}:{i}" for i in range(num_blocks)]
            started = time.perf_counter()
            async with client.pipeline(transaction=False) as pipe:
                for key, value in zip(keys, values):
                    pipe.set(key, value)
                await pipe.execute()
            best["redis_set"] = max(best["redis_set"], payload_bytes / (time.perf_counter() - started))
            started = time.perf_counter()
            for start in range(0, num_blocks, 32):  # the same batching as KVTransfer's fetch
                got = await client.mget(keys[start:start + 32])
                assert all(v is not None for v in got)
            best["redis_get"] = max(best["redis_get"], payload_bytes / (time.perf_counter() - started))
        await client.aclose()

    asyncio.run(plain())
    return {name: value / 1e6 for name, value in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-ttft", action="store_true", help="measure goodput only")
    args = parser.parse_args()

    from deepinfer.engine.config import (CacheConfig, EngineConfig, KVTransferConfig, ModelConfig,
                               SchedulerConfig)
    from deepinfer.engine.engine_core import EngineCore

    process, url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        core = EngineCore(EngineConfig(
            model=ModelConfig(model=args.model, dtype="float32", device="cpu"),
            cache=CacheConfig(block_size=16, num_blocks=args.prompt_tokens // 16 + 64),
            scheduler=SchedulerConfig(max_num_batched_tokens=512),
            kv_transfer=KVTransferConfig(kv_store=url, timeout_s=10.0)))
        vocab = core.vocab_size
        prompt_ids = [(17 + 7919 * i) % (vocab - 100) + 50 for i in range(args.prompt_tokens)]
        if not args.skip_ttft:
            ttft(core, [i + 1 for i in prompt_ids[:64]], "warmup")  # another prefix
            cold_s, hit_s, cached = measure_ttft(core, prompt_ids)
            print(f"TTFT, {args.prompt_tokens}-token prompt: cold prefill {cold_s * 1e3:.0f} ms, "
                  f"loaded from Redis {hit_s * 1e3:.0f} ms ({cached} tokens loaded); "
                  f"hit/cold = {hit_s / cold_s:.2f} (target <= 0.30)")
        num_blocks = args.prompt_tokens // 16
        rates = measure_goodput(core, url, num_blocks, args.repeats)
        block_kib = core.kv_transfer.header.num_bytes / 1024
        print(f"goodput, {num_blocks} blocks of {block_kib:.0f} KiB: "
              f"save {rates['ours_save']:.0f} MB/s vs redis-py SET {rates['redis_set']:.0f} MB/s "
              f"({rates['ours_save'] / rates['redis_set']:.2f}x); "
              f"load {rates['ours_load']:.0f} MB/s vs redis-py MGET {rates['redis_get']:.0f} MB/s "
              f"({rates['ours_load'] / rates['redis_get']:.2f}x)")
        core.close()
    finally:
        if process is not None:
            process.kill()


if __name__ == "__main__":
    main()
