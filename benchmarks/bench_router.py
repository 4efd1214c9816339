"""Router overhead, and prefix-affinity vs round-robin on a multi-turn shared-prefix trace.

    python benchmarks/bench_router.py [--requests 100] [--conversations 8] [--turns 4]

Starts two `deepinfer serve` workers (the embedded SmolLM2) and `deepinfer router` processes.
1. Overhead: sequential /v1/completions requests, alternately straight to an upstream and
   through a router whose only backend it is; prints latency p50/p99 of each and the added
   latency (router - direct) at p50 and p99. Two upstreams: a no-op one answering a canned
   body at once (the router's own cost, unblurred), and worker 1 with max_tokens=1.
2. Trace: `--conversations` chats, each a long shared system prompt + its own first message,
   `--turns` turns each (the assistant's answer and a new question appended per turn), replayed
   with the conversations running concurrently and each one's turns in order, once through a
   round-robin router and once through a prefix_affinity router over both workers. Prints
   requests/s, generated tokens/s, and the prefix-cache hit rate of the workers (hit tokens /
   queried prompt tokens, from their /metrics, deltas over the run). Each run uses fresh
   conversation texts, so the second run gains nothing from the first one's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.processes import ServerProcess, deepinfer  # noqa: E402
SYSTEM = ("You are a meticulous assistant for a garden centre. You know every plant, tool and "
          "fertiliser we sell, our opening hours (nine to six, closed on Mondays), our return "
          "policy (thirty days with a receipt) and our delivery area (ten miles). Answer in one "
          "or two short sentences, politely, and never invent products we do not sell. ")
GARDEN = ("My garden faces north, the soil is heavy clay, a tall beech hedge shades the east "
          "side until noon, there is a small pond near the back fence, and I grow tomatoes, "
          "lavender, two apple trees and a climbing hydrangea on the shed. ")


def start(args: list[str] | None, log: Path) -> ServerProcess:
    """`deepinfer ARGS --port P`, or this file's null upstream when `args` is None."""
    command = (deepinfer(*args) if args is not None
               else lambda port: [sys.executable, __file__, "--serve-null", str(port)])
    return ServerProcess(log.stem, command, log)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def serve_null(port: int) -> None:
    """An upstream that answers every completion at once with a canned body: with it, the
    router's added latency is not hidden under the model's."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    canned = {"id": "cmpl-null", "object": "text_completion", "created": 0, "model": "null",
              "choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse(canned)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def overhead(label: str, direct: str, routed: str, requests: int) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as client:
        for url in (direct, routed):  # warm-up: connections, the prefix cache
            client.post(url + "/v1/completions", json=body)
        for _ in range(requests):
            for name, url in (("direct", direct), ("router", routed)):
                start = time.perf_counter()
                client.post(url + "/v1/completions", json=body).raise_for_status()
                times[name].append(time.perf_counter() - start)
    (d50, d99), (r50, r99) = ((percentile(times[name], 50) * 1e3,
                               percentile(times[name], 99) * 1e3) for name in ("direct", "router"))
    print(f"overhead, {label} ({requests} sequential requests each): direct p50 {d50:.2f} ms "
          f"p99 {d99:.2f} ms | router p50 {r50:.2f} ms p99 {r99:.2f} ms | added p50 "
          f"{r50 - d50:+.2f} ms p99 {r99 - d99:+.2f} ms")


def prefix_counters(workers: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in workers:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                if sample.name == "deepinfer:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "deepinfer:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


async def conversation(client: httpx.AsyncClient, url: str, tag: str, turns: int) -> int:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Customer {tag}. {GARDEN}Which roses grow well in "
                                            "shade, and how often should I water them?"}]
    generated = 0
    for turn in range(turns):
        reply = await client.post(url + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        reply.raise_for_status()
        data = reply.json()
        generated += data["usage"]["completion_tokens"]
        messages += [{"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Thanks. Follow-up question {turn} from {tag}?"}]
    return generated


async def replay(url: str, run: str, conversations: int, turns: int) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        generated = await asyncio.gather(*(conversation(client, url, f"{run}-{i}", turns)
                                           for i in range(conversations)))
        return time.perf_counter() - start, sum(generated)


def trace(workers: list[str], routers: dict[str, str], conversations: int, turns: int) -> None:
    for name, url in routers.items():
        hits0, queries0 = prefix_counters(workers)
        elapsed_s, generated = asyncio.run(replay(url, name, conversations, turns))
        hits, queries = prefix_counters(workers)
        requests = conversations * turns
        print(f"trace {name:>16}: {requests} requests in {elapsed_s:.1f} s = "
              f"{requests / elapsed_s:.2f} req/s, {generated / elapsed_s:.1f} generated tok/s, "
              f"prefix-cache hit rate {(hits - hits0) / max(queries - queries0, 1):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--serve-null", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_null:
        serve_null(args.serve_null)
        return
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    worker_args = ["serve", "--max-num-seqs", "16", "--log-level", "warning"]
    procs = [start(worker_args, logs / f"bench_router_w{i}.log") for i in range(2)]
    try:
        workers = [p.wait_ready().url for p in procs]
        router_args = ["router", "--log-level", "warning"]
        single = start([*router_args, "--backend", workers[0]], logs / "bench_router_r0.log")
        null = start(None, logs / "bench_router_null.log")
        null_router = start([*router_args, "--backend", null.url],
                           logs / "bench_router_rnull.log")
        procs.extend([single, null, null_router])
        pair = {policy: start([*router_args, "--policy", policy, "--backend", workers[0],
                              "--backend", workers[1]], logs / f"bench_router_{policy}.log")
                for policy in ("round_robin", "prefix_affinity")}
        procs.extend(pair.values())
        for proc in procs:
            proc.wait_ready()
        overhead("no-op upstream", null.url, null_router.url, args.requests)
        overhead("SmolLM2 worker, max_tokens=1", workers[0], single.url, args.requests)
        for url in workers:  # the shared system prompt is cached on both before either run
            asyncio.run(replay(url, "warm-up", 1, 1))
        trace(workers, {p: proc.url for p, proc in pair.items()}, args.conversations,
              args.turns)
    finally:
        for proc in procs:
            proc.kill()


if __name__ == "__main__":
    main()
