"""Soak: one real `deepinfer serve` on loopback under steady mixed load; RSS and KV over time.

Answers "is the worker's resident memory growing without bound?" (issue 26.8). It starts the
worker itself (embedded default model unless --model), then runs `--concurrency` clients for
`--duration-s` seconds, each looping over a mix of requests: chat and completions, streamed and
not, greedy and seeded sampling, varied prompt and output lengths, and a share of streams that
the client drops midway (a disconnect must free the request's blocks). Every `--sample-s`
seconds it records the worker's RSS (/proc/PID/status VmRSS), the KV blocks in use (from
/metrics: `kv_cache_usage_perc` x the --num-kv-blocks it served with), running/waiting requests
and the requests done so far; the JSON result is rewritten after each sample, so a run cut short
still leaves its curve.

Bounded: loopback only (the worker binds 127.0.0.1), a hard cap on duration and concurrency.

    python -m benchmarks.soak --duration-s 3600 --concurrency 3 --out /work/soak_results.json

The summary printed at the end: RSS at start, every 10 minutes and at the end; the RSS slope
over the second half (MiB per 1,000 requests; ~0 for no leak); KV blocks in use once idle
(must be 0: every finished or dropped request freed its blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.processes import ServerProcess, deepinfer  # noqa: E402

MAX_DURATION_S = 6 * 3600
MAX_CONCURRENCY = 64
NUM_KV_BLOCKS = 1024
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("route"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def make_request(rng: random.Random) -> tuple[str, dict, bool, bool]:
    """(path, body, stream, drop midway) for one random request."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))
    stream = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(1, 48), "stream": stream}
    if rng.random() < 0.5:
        body["temperature"], body["seed"] = 0.8, rng.randrange(2**32)
    else:
        body["temperature"] = 0.0
    if rng.random() < 0.6:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Repeat after me: {words}"}]
    else:
        path = "/v1/completions"
        body["prompt"] = words
    return path, body, stream, stream and rng.random() < 0.25


class Counters:
    def __init__(self) -> None:
        self.done = 0
        self.dropped = 0
        self.errors: dict[str, int] = {}


async def client_loop(url: str, seed: int, stop_at: float, counters: Counters) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < stop_at:
            path, body, stream, drop = make_request(rng)
            try:
                if not stream:
                    reply = await client.post(path, json=body)
                    key = str(reply.status_code)
                else:
                    async with client.stream("POST", path, json=body) as reply:
                        key = str(reply.status_code)
                        async for line in reply.aiter_lines():
                            if drop and line.startswith("data:"):
                                counters.dropped += 1
                                break   # leaving the block closes the connection mid-stream
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            if key == "200":
                counters.done += 1
            else:
                counters.errors[key] = counters.errors.get(key, 0) + 1


def summarize(samples: list[dict], every_s: float = 600) -> dict:
    """RSS at start, each `every_s` mark and the end; slope over the second half."""
    marks, next_mark = [], 0.0
    for sample in samples:
        if sample["t_s"] >= next_mark:
            marks.append({k: sample[k] for k in ("t_s", "rss_mib", "kv_blocks_in_use",
                                                  "requests_done")})
            next_mark += every_s
    if samples and marks[-1]["t_s"] != samples[-1]["t_s"]:
        last = samples[-1]
        marks.append({k: last[k] for k in ("t_s", "rss_mib", "kv_blocks_in_use",
                                           "requests_done")})
    half = samples[len(samples) // 2:]
    slope = None
    if len(half) >= 2 and half[-1]["requests_done"] > half[0]["requests_done"]:
        slope = ((half[-1]["rss_mib"] - half[0]["rss_mib"]) * 1000
                 / (half[-1]["requests_done"] - half[0]["requests_done"]))
    return {"marks": marks, "rss_slope_second_half_mib_per_1000_requests": slope,
            "rss_max_mib": max((s["rss_mib"] for s in samples), default=None)}


async def sample_loop(server: ServerProcess, args: argparse.Namespace, counters: Counters,
                      stop_at: float, result: dict) -> None:
    t0 = time.monotonic()
    while True:
        stats = await asyncio.to_thread(scrape, server.url)
        sample = {"t_s": round(time.monotonic() - t0, 1),
                  "rss_mib": round(rss_bytes(server.proc.pid) / 2**20, 1),
                  "kv_blocks_in_use": round(stats.get("deepinfer:kv_cache_usage_perc", 0)
                                            * NUM_KV_BLOCKS),
                  "running": stats.get("deepinfer:num_requests_running", 0),
                  "waiting": stats.get("deepinfer:num_requests_waiting", 0),
                  "requests_done": counters.done, "streams_dropped": counters.dropped,
                  "errors": dict(counters.errors)}
        result["samples"].append(sample)
        result["summary"] = summarize(result["samples"])
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(sample), flush=True)
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(args.sample_s, max(stop_at - time.monotonic(), 0.1)))


async def idle_stats(url: str, timeout_s: float = 60) -> dict[str, float]:
    """/metrics once no request runs or waits (aborts of dropped streams land at the next
    step), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        await asyncio.sleep(1)
        stats = await asyncio.to_thread(scrape, url)
        busy = (stats.get("deepinfer:num_requests_running", 0)
                + stats.get("deepinfer:num_requests_waiting", 0))
        if busy == 0 or time.monotonic() > deadline:
            return stats


async def soak(server: ServerProcess, args: argparse.Namespace) -> dict:
    counters = Counters()
    result = {"config": vars(args), "samples": []}
    stop_at = time.monotonic() + args.duration_s
    sampler = asyncio.create_task(sample_loop(server, args, counters, stop_at, result))
    await asyncio.gather(*(client_loop(server.url, args.seed + i, stop_at, counters)
                           for i in range(args.concurrency)))
    await sampler
    stats = await idle_stats(server.url)   # every block must be back
    result["idle_kv_blocks_in_use"] = round(stats.get("deepinfer:kv_cache_usage_perc", 0)
                                            * NUM_KV_BLOCKS)
    result["idle_rss_mib"] = round(rss_bytes(server.proc.pid) / 2**20, 1)
    result["summary"] = summarize(result["samples"])
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=3600)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model dir (default: embedded)")
    parser.add_argument("--out", default="soak_results.json")
    parser.add_argument("--log", default="soak_server.log")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="extra `deepinfer serve` argument (repeat), e.g. "
                             "--serve-arg=--kv-store --serve-arg=none to tell the KV store's "
                             "share of RSS from the rest")
    args = parser.parse_args(argv)
    if not 0 < args.duration_s <= MAX_DURATION_S:
        parser.error(f"--duration-s {args.duration_s} must be in (0, {MAX_DURATION_S}]")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency {args.concurrency} must be in [1, {MAX_CONCURRENCY}]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    serve = ["serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
             "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "8",
             "--log-level", "warning", *args.serve_arg]
    server = ServerProcess("soak-worker", deepinfer(*serve), Path(args.log))
    try:
        server.wait_ready()
        result = asyncio.run(soak(server, args))
    finally:
        server.kill()
    print(json.dumps({"summary": result["summary"],
                      "idle_kv_blocks_in_use": result["idle_kv_blocks_in_use"],
                      "idle_rss_mib": result["idle_rss_mib"]}, indent=1))
    return 0 if result["idle_kv_blocks_in_use"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
