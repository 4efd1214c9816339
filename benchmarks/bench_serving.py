"""Decode throughput through the HTTP API vs HF transformers `generate`, same weights, same run.

    python benchmarks/bench_serving.py [--model PATH] [--new-tokens 64] [--concurrency 16]

1. HF transformers: `generate` (greedy, exactly N new tokens) for 1 prompt, then for the 16
   prompts as one left-padded batch; tokens/s = generated tokens / wall time.
2. deepinfer: a real `deepinfer serve` process; 1 streaming request, then 16 concurrent
   requests through /v1/completions (greedy, ignore_eos, max_tokens=N); same formula.
Prints each pair and the ratio deepinfer / HF. Both sides include prefill in their time.

GPU mode (`--gpu`, issue 29): random bf16 weights in the Llama-3.2-1B and Llama-3-8B shapes, a
word-level tokenizer, 128-token prompts sent as token ids, 256 new tokens, ignore_eos,
streaming /v1/completions from 8 client processes (httpx). Per shape: the offline loop
(`LLM.generate`'s: submit all, step to the end) with the same engine settings, then the server
as `deepinfer serve --api-server-count N` lays it out (server/api_servers.py: N API server
processes on one socket, the engine core in its own process) for each N of
`--api-server-count`, and with `--thread-baseline` also uvicorn in this process with the engine
core on a thread (the old design), at 64 and 256 streams. Prints tok/s and its share of
offline, TTFT p50/p99 (and p50 over the offline prefill time), ITL p50/p99 and tokens per
event. ITL as vLLM's benchmark_serving measures it: the gaps between a stream's
content-bearing SSE events (non-empty text), whatever the tokens each holds; an event holds
several tokens when the server coalesced the steps a lagging stream had queued.

    python benchmarks/bench_serving.py --gpu [--shapes 1b,8b] [--streams 64,256]
        [--api-server-count 1,4] [--thread-baseline] [--json PATH]
    python benchmarks/bench_serving.py --gpu --device cpu --shapes tiny --streams 8 \
        --new-tokens 16     # a CPU dry run of the GPU mode
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import deepinfer as _package  # noqa: E402,F401  (moves the checkout root behind site-packages)
from tests.processes import ServerProcess, deepinfer  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire began", "Write a short poem about the sea.",
    "Explain how a bicycle works.", "The best way to learn programming is",
    "Once upon a time in a small village,", "What are the main causes of climate change?",
    "Describe the water cycle in simple terms.", "List three benefits of regular exercise:",
    "In computer science, a hash table is", "The recipe for a simple tomato soup:",
    "Why is the sky blue?", "A letter to a friend about my holiday:",
    "The three laws of motion state that", "How do vaccines train the immune system?",
    "Tips for a good night's sleep include", "The capital cities of Europe include",
]


def hf_throughput(model_dir: Path, prompts: list[str], new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        model.generate(**tokenizer(prompts[:1], return_tensors="pt"), max_new_tokens=4,
                       do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(**batch, **kwargs)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    return generated / elapsed


async def one_request(client: httpx.AsyncClient, model: str, prompt: str,
                      new_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def server_throughput(port: int, prompts: list[str], new_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, model, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_request(client, model, p, new_tokens)
                                        for p in prompts))
        elapsed = time.perf_counter() - start
    assert all(c == new_tokens for c in counts), counts
    return sum(counts) / elapsed


# ---- GPU mode ------------------------------------------------------------------------------
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
SHAPES["tiny"] = dict(SHAPES["1b"], hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=2048)   # a CPU smoke test of the GPU mode (--device cpu)
CLIENT_PROCESSES = 8


def random_llama(shape: dict, device: str = "cuda"):
    """Our Llama in bf16 on CUDA (float32 on CPU) with HF's random init (seed 0), as
    benchmarks/gpu_decode.py builds it. Module level: the engine core process calls it
    (spawn pickles it by name)."""
    import gc

    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from deepinfer.engine.models.llama import LlamaForCausalLM

    config = LlamaConfig(**shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf_model = HFLlama(config).eval()
            ours = LlamaForCausalLM(config, dtype)
    finally:
        torch.set_default_dtype(previous)
    ours.load_weights(hf_model.state_dict().items())
    del hf_model
    gc.collect()
    _empty_cache()
    return ours.eval()


def _empty_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _gpu_config(model_dir: Path, engine_process: bool, device: str, api_server_count: int = 1):
    from deepinfer.engine.config import EngineConfig

    return EngineConfig().replace(
        model={"model": str(model_dir), "device": device,
               "dtype": "bfloat16" if device == "cuda" else "float32"},
        # a fixed KV cache (256 x 384 tokens fit 1.3 times over): the same for the offline
        # and the served engine, whatever memory the other left behind
        cache={"enable_prefix_caching": False, "num_blocks": 8192},
        scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "max_waiting_requests": 4096},
        kv_transfer={"kv_store": "none"},
        frontend={"engine_process": engine_process, "api_server_count": api_server_count})


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def offline_run(core, prompts: list[list[int]], new_tokens: int) -> dict:
    """`LLM.generate`'s loop on `core`: submit all, step to the end. tok/s over the whole
    run (prefill included, as the server's) and the prefill time (until every request has
    its first token)."""
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        core.add_request(core.make_request(prompt, params))
    started, total, prefill_s = set(), 0, None
    while core.has_unfinished_requests():
        for out in core.step():
            started.add(out.request_id)
            total += len(out.new_token_ids)
        if prefill_s is None and len(started) == len(prompts):
            prefill_s = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    return {"tok_s": total / elapsed, "prefill_s": prefill_s, "tokens": total}


async def _timed_stream(client, model: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        server = response.headers.get("x-deepinfer-api-server", "0")
        async for line in response.aiter_lines():
            if not line.startswith('data: {"id"'):
                continue
            if '"choices":[]' in line:     # the usage chunk: the tokens
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif '"text":""' not in line:  # a content-bearing event (vLLM's ITL definition)
                times.append(time.perf_counter())
    return {"ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:])],
            "chunks": tokens, "events": len(times), "start": start, "end": times[-1],
            "server": server}


def _client_task(url: str, model: str, prompts: list[list[int]], new_tokens: int,
                 start_at: float) -> list[dict]:
    """One client process's share of the streams, all sent at `start_at` (epoch seconds)."""
    async def run():
        limits = httpx.Limits(max_connections=len(prompts) + 2)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await asyncio.gather(*(_timed_stream(client, model, p, new_tokens)
                                          for p in prompts))

    out = asyncio.run(run())
    offset = time.time() - time.perf_counter()      # to epoch seconds, comparable across
    return [{**r, "start": r["start"] + offset, "end": r["end"] + offset} for r in out]


def serve_run(pool, url: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """`prompts` streamed at once from the `pool`'s CLIENT_PROCESSES processes."""
    import collections
    import statistics

    start_at = time.time() + 0.5
    parts = pool.starmap(_client_task, [(url, model, prompts[i::CLIENT_PROCESSES], new_tokens,
                                         start_at) for i in range(CLIENT_PROCESSES)])
    streams = [r for part in parts for r in part]
    tokens = sum(s["chunks"] for s in streams)
    elapsed = max(s["end"] for s in streams) - min(s["start"] for s in streams)
    itl = sorted(x for s in streams for x in s["itl"])
    ttft = sorted(s["ttft"] for s in streams)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    return {"tok_s": tokens / elapsed, "tokens": tokens,
            "ttft_ms": (pct(ttft, 0.5), pct(ttft, 0.99)), "itl_ms": (pct(itl, 0.5),
                                                                      pct(itl, 0.99)),
            "itl_mean_ms": statistics.fmean(itl) * 1e3,
            "tokens_per_event": tokens / sum(s["events"] for s in streams),
            "streams_per_api_server": sorted(collections.Counter(
                s["server"] for s in streams).values(), reverse=True)}


def _serve_in_thread(engine):
    """uvicorn serving `build_app(engine)` in a thread of this process (the engine core is
    in this process or its child, per the config); returns (url, stop)."""
    import threading

    import uvicorn

    from deepinfer.server.app import build_app
    from tests.processes import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)

    def stop():
        server.should_exit = True
        thread.join(30)
    return url, stop


def _wait_healthy(url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def _serve_processes(config, factory):
    """`deepinfer serve --api-server-count N`'s processes (server/api_servers.py) with the
    model built by `factory` in the engine core; returns (url, stop)."""
    from deepinfer.server.api_servers import APIServers
    from deepinfer.server.cli import build_parser
    from tests.processes import free_port

    port = free_port()
    args = build_parser().parse_args(["serve", "--port", str(port), "--log-level", "warning"])
    servers = APIServers(config, args, model_factory=factory)
    servers.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
    except BaseException:
        servers.stop()
        servers.stop()
        servers.close()
        raise

    def stop():
        servers.stop()
        servers.wait()
        servers.close()
    return url, stop


def gpu_main(args) -> dict:
    """Per shape: offline runs (EngineCore in this process), then the server in each layout
    (N API server processes + the engine core process, for each N of --api-server-count;
    --thread-baseline: uvicorn and the engine core in this process) at every stream count;
    prints share of offline tok/s, TTFT and ITL percentiles. Results are printed (and written
    to --json) as they come, so a run cut short keeps what it measured."""
    import functools
    import multiprocessing

    from transformers import LlamaConfig

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_decode import write_model_dir

    from deepinfer.engine.async_llm import AsyncLLM, freeze_startup_heap
    from deepinfer.engine.engine_core import EngineCore

    report = {}
    streams_list = [int(s) for s in args.streams.split(",")]
    layouts = [f"api{n}" for n in args.api_server_count.split(",") if n]
    layouts += ["thread"] if args.thread_baseline else []
    pool = multiprocessing.get_context("spawn").Pool(CLIENT_PROCESSES)
    pool.map(abs, range(CLIENT_PROCESSES))   # the clients started before anything is timed
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        model_dir = write_model_dir(Path(tempfile.mkdtemp()) / shape_name, LlamaConfig(**shape))
        prompts = {n: _prompts(n, args.prompt_tokens, shape["vocab_size"], n)
                   for n in streams_list}
        factory = functools.partial(random_llama, shape, args.device)
        core = EngineCore(_gpu_config(model_dir, False, args.device), model=factory())
        for n in streams_list:   # warm-up at each batch: Triton compiles and autotunes
            offline_run(core, prompts[n], 4)   # per shape on first use (run 1 did not)
        offline = {n: offline_run(core, prompts[n], args.new_tokens) for n in streams_list}
        core.close()
        del core
        _empty_cache()
        for n in streams_list:
            print(f"{shape_name} offline {n:4d} streams: {offline[n]['tok_s']:9.0f} tok/s, "
                  f"prefill {offline[n]['prefill_s'] * 1e3:.0f} ms", flush=True)
            report[f"{shape_name}/offline/{n}"] = offline[n]
        for layout in layouts:
            if layout == "thread":
                engine = AsyncLLM(_gpu_config(model_dir, False, args.device),
                                  model_factory=factory)
                freeze_startup_heap()
                url, serving_stop = _serve_in_thread(engine)

                def stop():
                    serving_stop()
                    engine.shutdown()
            else:
                url, stop = _serve_processes(_gpu_config(model_dir, True, args.device,
                                                         int(layout[3:])), factory)
            try:
                model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                for n in streams_list:   # warm-up, as offline
                    serve_run(pool, url, model_id, prompts[n], 4)
                for n in streams_list:
                    result = serve_run(pool, url, model_id, prompts[n], args.new_tokens)
                    result["share"] = result["tok_s"] / offline[n]["tok_s"]
                    result["ttft_over_prefill"] = (result["ttft_ms"][0] / 1e3
                                                   / offline[n]["prefill_s"])
                    key = f"{shape_name}/{layout}/{n}"
                    report[key] = result
                    print(f"{key:18} {result['tok_s']:9.0f} tok/s  share {result['share']:.2f}"
                          f"  TTFT p50/p99 {result['ttft_ms'][0]:.0f}/{result['ttft_ms'][1]:.0f}"
                          f" ms ({result['ttft_over_prefill']:.2f}x offline prefill)  ITL "
                          f"p50/p99 {result['itl_ms'][0]:.1f}/{result['itl_ms'][1]:.1f} ms  "
                          f"{result['tokens_per_event']:.2f} tok/event  streams per API "
                          f"server {result['streams_per_api_server']}", flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(report, indent=1))
            finally:
                stop()
            _empty_cache()
    pool.terminate()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--gpu", action="store_true",
                        help="GPU mode: random-weight Llama shapes, offline vs served")
    parser.add_argument("--shapes", default="1b,8b", help="GPU mode: of " + ",".join(SHAPES))
    parser.add_argument("--streams", default="64,256", help="GPU mode: concurrent streams")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="GPU mode")
    parser.add_argument("--api-server-count", default="1,4",
                        help="GPU mode: serve with N API server processes and the engine core "
                             "process, for each N of this comma-separated list")
    parser.add_argument("--thread-baseline", action="store_true",
                        help="GPU mode: also serve from this process, the engine core on a "
                             "thread (the design before the engine core process)")
    parser.add_argument("--json", default=None, help="GPU mode: write the results here")
    parser.add_argument("--device", default="cuda", help="GPU mode: cpu for a smoke test")
    args = parser.parse_args()
    if args.gpu:
        if args.new_tokens == 64:
            args.new_tokens = 256
        report = gpu_main(args)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return

    from deepinfer.engine.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model, None)
    prompts = (PROMPTS * 4)[:args.concurrency]
    server = ServerProcess("server", deepinfer(
        "serve", *([args.model] if args.model else []),
        "--max-num-seqs", str(max(args.concurrency, 1))), Path(tempfile.gettempdir()) / "bench_serving.log")
    try:
        server.wait_ready(600)
        ours_1 = asyncio.run(server_throughput(server.port, prompts[:1], args.new_tokens))
        ours_n = asyncio.run(server_throughput(server.port, prompts, args.new_tokens))
    finally:
        server.kill()
    hf_1 = hf_throughput(model_dir, prompts[:1], args.new_tokens)
    hf_n = hf_throughput(model_dir, prompts, args.new_tokens)
    print(f"model: {model_dir.name}  new tokens: {args.new_tokens}  torch threads: "
          f"{os.cpu_count()} cores")
    print(f"{'':24}{'deepinfer tok/s':>16}{'HF tok/s':>12}{'ratio':>8}")
    print(f"{'1 stream':24}{ours_1:16.1f}{hf_1:12.1f}{ours_1 / hf_1:8.2f}x")
    print(f"{f'{args.concurrency} concurrent':24}{ours_n:16.1f}{hf_n:12.1f}{ours_n / hf_n:8.2f}x")


if __name__ == "__main__":
    main()
