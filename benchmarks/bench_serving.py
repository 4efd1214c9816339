"""Decode throughput through the HTTP API vs HF transformers `generate`, same weights, same run.

    python benchmarks/bench_serving.py [--model PATH] [--new-tokens 64] [--concurrency 16]

1. HF transformers: `generate` (greedy, exactly N new tokens) for 1 prompt, then for the 16
   prompts as one left-padded batch; tokens/s = generated tokens / wall time.
2. deepinfer: a real `deepinfer serve` process; 1 streaming request, then 16 concurrent
   requests through /v1/completions (greedy, ignore_eos, max_tokens=N); same formula.
Prints each pair and the ratio deepinfer / HF. Both sides include prefill in their time.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

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
