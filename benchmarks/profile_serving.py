"""Where a streamed token's CPU time goes in `deepinfer serve`: py-spy samples, by stage.

    python benchmarks/profile_serving.py [--streams 64] [--new-tokens 128] [-- SERVE FLAGS...]

Starts `deepinfer serve` on a tiny random Llama (2 layers, hidden 64, the SmolLM2 tokenizer:
the model costs little, so the serving path shows), records it with `py-spy record` (100 Hz,
busy samples only, every thread, child processes too) while `--streams` streaming
/v1/completions clients (ignore_eos, `--new-tokens` each) run from this process, then prints
CPU microseconds per generated token per stage. A sample's stage is that of its deepest frame with a
marker of `STAGES` (so SSE JSON inside a handler counts as SSE JSON, not as the handler).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.processes import ServerProcess, deepinfer  # noqa: E402

RATE_HZ = 100
# (stage, markers): the first stage with a marker in a sample's stack takes the sample
STAGES = [
    ("model forward + sampling", ("model_runner.py", "executor.py", "sampler.py")),
    ("scheduler + core bookkeeping", ("scheduler.py", "kv_cache/", "engine_core.py",
                                      "kv_transfer.py")),
    ("detokenize + stop strings", ("output_processor.py", "detokenizer.py")),
    ("engine<->API hand-off (queues, ZMQ, msgspec)", ("async_llm.py", "core_client.py",
                                                      "core_proc.py", "zmq/")),
    ("SSE JSON (pydantic/orjson)", ("sse.py", "pydantic", "orjson")),
    ("OpenAI chunk building + stream merge", ("serving_completion.py", "serving_chat.py",
                                              "generation.py", "metrics.py")),
    ("uvicorn/starlette/asyncio", ("uvicorn", "starlette", "h11", "asyncio", "httptools",
                                   "uvloop")),
]


async def _stream(client: httpx.AsyncClient, model: str, new_tokens: int) -> int:
    body = {"model": model, "prompt": "The history of the Roman Empire began",
            "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens",
                                                                        tokens)
    return tokens


async def _load(url: str, streams: int, new_tokens: int, warm_up: bool) -> int:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if warm_up:   # several connections at once: every API server process warms up
            await asyncio.gather(*(_stream(client, model, 4) for _ in range(16)))
            return 0
        counts = await asyncio.gather(*(_stream(client, model, new_tokens)
                                        for _ in range(streams)))
    return sum(counts)


def classify(stack: str) -> str:
    """The stage of the deepest frame with a specific marker (the last stage's generic
    markers, event loop and HTTP, count only when no other frame has one)."""
    frames = stack.split(";")[::-1]
    for specific in (STAGES[:-1], STAGES[-1:]):
        for frame in frames:
            for stage, markers in specific:
                if any(marker in frame for marker in markers):
                    return stage
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("serve_flags", nargs="*", help="extra `deepinfer serve` flags")
    args = parser.parse_args()

    from deepinfer.engine.loader import load_tokenizer, resolve_model_dir
    from tests.tiny_models import save_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="profile-serving-"))
    model_dir = save_tiny_llama(work / "tiny", load_tokenizer(resolve_model_dir(None, None)))
    server = ServerProcess("server", deepinfer(
        "serve", str(model_dir), "--device", "cpu", "--max-num-seqs", str(args.streams),
        "--max-num-batched-tokens", "2048", *args.serve_flags), work / "server.log")
    try:
        server.wait_ready(600)
        asyncio.run(_load(server.url, args.streams, args.new_tokens, warm_up=True))
        raw = work / "stacks.txt"
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record",
                                "--pid", str(server.proc.pid), "--rate", str(RATE_HZ),
                                "--format", "raw", "--subprocesses", "--threads",
                                "--nonblocking", "--output", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        start = time.perf_counter()
        tokens = asyncio.run(_load(server.url, args.streams, args.new_tokens, warm_up=False))
        elapsed = time.perf_counter() - start
        spy.send_signal(2)   # SIGINT: py-spy writes its file and exits
        spy.wait(60)
    finally:
        server.kill()
    samples: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples[classify(stack)] += int(count)
    print(f"{args.streams} streams x {args.new_tokens} tokens: {tokens} tokens in {elapsed:.2f}"
          f" s = {tokens / elapsed:.0f} tok/s; flags: {' '.join(args.serve_flags) or '-'}")
    print(f"{'stage':48}{'CPU us/token':>14}")
    total = 0.0
    for stage, _ in STAGES + [("other", ())]:
        us = samples[stage] / RATE_HZ / tokens * 1e6
        total += us
        print(f"{stage:48}{us:14.1f}")
    print(f"{'total (all threads and processes)':48}{total:14.1f}")


if __name__ == "__main__":
    main()
