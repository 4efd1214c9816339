"""Deterministic serving, as processes: `deepinfer serve --batch-invariant` (embedded SmolLM2)
answers a request with the same token ids and logprob floats alone, among 15 concurrent
requests, and through `deepinfer router` over prefill / decode workers sharing a private
`redis-server`, as a monolithic worker does alone. Greedy and seeded requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import RedisServer
from tests.e2e.test_router_e2e import MODEL, STARTUP_TIMEOUT_S, router_args, start, worker_args
from tests.processes import ServerProcess

pytestmark = pytest.mark.slow

TARGETS = [
    {"prompt": "The history of the printing press begins", "max_tokens": 24, "ignore_eos": True, "temperature": 0},
    {"prompt": "Write a haiku about rain.", "max_tokens": 24, "ignore_eos": True, "temperature": 0.9,
     "seed": 7, "top_p": 0.95},
    {"prompt": "List three prime numbers:", "max_tokens": 24, "ignore_eos": True, "temperature": 0.7, "seed": 1},
]
LOAD = [{"prompt": f"Fact {i} about {topic}:", "max_tokens": 8 + 3 * i,
         "temperature": 0.5 * (i % 3), "seed": i}
        for i, topic in enumerate(["rivers", "Rome", "bread", "glass", "owls", "rain", "iron",
                                   "music", "snow", "tea", "maps", "salt", "wind", "silk",
                                   "clocks"])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-invariant-e2e")
    procs: dict[str, ServerProcess] = {}
    redis = RedisServer().start()
    try:
        procs["mono"] = start("mono", worker_args("--batch-invariant"), tmp)
        for role in ("prefill", "decode"):
            procs[role] = start(role, worker_args("--batch-invariant", "--role", role,
                                                  "--kv-store", redis.url), tmp)
        for proc in procs.values():
            proc.wait_ready(STARTUP_TIMEOUT_S)
        procs["pd"] = start("pd", router_args("--prefill", procs["prefill"].url,
                                             "--decode", procs["decode"].url),
                           tmp).wait_ready(60)
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
        redis.stop()


def complete(base: str, body: dict) -> tuple:
    """(token strings, their logprobs, the top-5 alternatives): compared bit for bit (JSON
    floats round-trip exactly)."""
    reply = httpx.post(base + "/v1/completions", json={"model": MODEL, "logprobs": 5, **body},
                       timeout=600)
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]


def under_load(base: str) -> list[tuple]:
    """The targets sent together with the 15 LOAD requests, all at once."""
    with ThreadPoolExecutor(len(TARGETS) + len(LOAD)) as pool:
        futures = [pool.submit(complete, base, body) for body in LOAD[:8] + TARGETS + LOAD[8:]]
        results = [f.result() for f in futures]
    return results[8:8 + len(TARGETS)]


def test_alone_equals_under_load_and_disaggregated(cluster):
    mono, pd = cluster["mono"].url, cluster["pd"].url
    alone = [complete(mono, body) for body in TARGETS]
    assert all(len(tokens) == 24 for tokens, _, _ in alone)
    assert under_load(mono) == alone
    assert under_load(pd) == alone
