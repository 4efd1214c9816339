"""`deepinfer serve --api-server-count 2` on real processes (issue 29): two API server
processes on one port, one engine core. Concurrent streams give the offline engine's tokens,
both API servers serve, /metrics from either counts every request, a client that disconnects
frees its request in the core, and SIGTERM drains the streams in flight before every process
(API servers, then the core) exits."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import ServerProcess, child_pids, deepinfer, metric, running
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# the streams in flight at SIGTERM: long enough (the tiny model has 512 positions) that they
# are still running when /health is asked, also on a fast machine
DRAIN_TOKENS = 480
# streams per client thread at SIGTERM (two threads; --max-num-seqs 8): 8 run, the others wait
# in the core, so the drain lasts at least two more waves of DRAIN_TOKENS steps (with one wave
# the tiny model finished in ~1 s on the 2-core box, both API servers exited, and /health met
# only refused connections)
DRAIN_STREAMS = 12


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                  on_first=None) -> dict:
    """One streamed completion; `on_first()` is called when its first event arrives."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if on_first is not None and len(events) == 1:
                    on_first()
    assert response.status_code == 200 and events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    return {"server": response.headers["x-deepinfer-api-server"],
            "text": "".join(c["text"] for chunk in chunks for c in chunk["choices"]),
            "tokens": chunks[-1]["usage"]["completion_tokens"]}


async def _streams(url: str, prompts: list[list[int]], max_tokens: int,
                   on_first=None) -> list[dict]:
    # a new connection per request: the kernel hashes each to one API server's socket
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, p, max_tokens, on_first)
                                      for p in prompts))


def _wait_for(condition, what: str, server: ServerProcess, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}:\n{server.log()}"
        time.sleep(0.1)


def test_two_api_servers_serve_count_abort_and_drain(tmp_path, smollm2_tokenizer):
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    model_dir = save_tiny_llama(tmp_path / "tiny", smollm2_tokenizer)
    server = ServerProcess("server", deepinfer(
        "serve", str(model_dir), "--device", "cpu", "--api-server-count", "2",
        "--served-model-name", "tiny", "--max-num-seqs", "8", "--num-kv-blocks", "256",
        "--graceful-shutdown-s", "60"), tmp_path / "server.log")
    try:
        server.wait_ready(300)
        prompts = [[100 + 7 * i + j for j in range(5 + i % 4)] for i in range(16)]
        llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=False)
        expected = [o.text for o in llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))]
        results = asyncio.run(_streams(server.url, prompts, NEW_TOKENS))
        sent = len(results)
        assert [r["text"] for r in results] == expected
        assert all(r["tokens"] == NEW_TOKENS for r in results)
        servers = collections.Counter(r["server"] for r in results)
        while set(servers) != {"0", "1"} and sent < 64:   # the kernel picks the socket
            more = asyncio.run(_streams(server.url, prompts, NEW_TOKENS))
            servers.update(r["server"] for r in more)
            sent += len(more)
        assert set(servers) == {"0", "1"}, servers

        # /metrics from either API server counts every API server's requests once; the
        # engine's own stats (from the one core) are not summed
        scrapes = collections.defaultdict(set)
        for _ in range(12):
            reply = httpx.get(server.url + "/metrics", headers={"connection": "close"})
            scrapes[reply.headers["x-deepinfer-api-server"]].add(sum(
                s.value for f in text_string_to_metric_families(reply.text) for s in f.samples
                if s.name == "deepinfer:request_success_total"
                and s.labels["finished_reason"] == "length"))
        assert all(counts == {float(sent)} for counts in scrapes.values()), scrapes
        assert metric(server.url, "deepinfer:http_requests_total",
                      route="/v1/completions", status_code="200") == sent
        assert metric(server.url, "deepinfer:generation_tokens_total") == sent * NEW_TOKENS
        assert metric(server.url, "deepinfer:prefix_cache_queries_total") > 0

        # a client that leaves mid-stream: its request is aborted in the core, blocks freed
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as response:
            next(response.iter_lines())
        _wait_for(lambda: metric(server.url, "deepinfer:request_success_total",
                                 finished_reason="abort") == 1, "abort not counted", server)
        _wait_for(lambda: metric(server.url, "deepinfer:num_requests_running") == 0
                  and metric(server.url, "deepinfer:kv_cache_usage_perc") == 0,
                  "the aborted request still holds the core", server)

        # SIGTERM: both API servers drain the streams in flight, then every process exits
        children = child_pids(server.proc.pid)
        assert len(children) == 3     # the core and two API servers
        finished: list[dict] = []
        started = threading.Semaphore(0)   # released by each stream's first event
        clients = [threading.Thread(target=lambda: finished.extend(asyncio.run(
            _streams(server.url, prompts[:DRAIN_STREAMS], DRAIN_TOKENS, started.release))))
            for _ in range(2)]
        for client in clients:
            client.start()
        # the first wave runs (a scrape of num_requests_running could miss them all on a
        # loaded box: 480 tokens of the tiny model take ~1-2 s)
        for _ in range(8):
            assert started.acquire(timeout=60), f"streams never started:\n{server.log()}"
        assert not finished
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        health = None
        for _ in range(20):   # a new connection may hash to an API server's closing socket
            try:
                health = httpx.get(server.url + "/health", timeout=10,
                                   headers={"connection": "close"})
                break
            except httpx.ConnectError:
                time.sleep(0.05)
        assert health is not None, f"no API server answered /health:\n{server.log()}"
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        for client in clients:
            client.join(120)
        assert len(finished) == 2 * DRAIN_STREAMS
        assert all(r["tokens"] == DRAIN_TOKENS for r in finished)
        assert server.proc.wait(60) == 0, server.log()
        assert not [pid for pid in children if running(pid)]
        assert "deepinfer: stopped" in server.log()
    finally:
        server.kill()


def test_a_dead_core_is_a_503_everywhere_and_sigterm_still_stops_every_process(
        tmp_path, smollm2_tokenizer):
    """The core SIGKILLed under two API servers: both answer 503 `engine_dead` (its advice
    said once), and SIGTERM still stops every process within the grace period (an API server's
    goodbye to the gone core used to block for ever in a ZMQ send, so nothing but SIGKILL
    ended the server)."""
    import os

    model_dir = save_tiny_llama(tmp_path / "tiny", smollm2_tokenizer)
    server = ServerProcess("server", deepinfer(
        "serve", str(model_dir), "--device", "cpu", "--api-server-count", "2",
        "--served-model-name", "tiny", "--num-kv-blocks", "64",
        "--graceful-shutdown-s", "20"), tmp_path / "server.log")
    try:
        server.wait_ready(300)
        children = child_pids(server.proc.pid)
        assert len(children) == 3     # the core (started first) and two API servers
        os.kill(min(children), signal.SIGKILL)
        _wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503,
                  "/health still 200 after the core died", server)
        for _ in range(4):            # new connections: both API servers answer
            answer = httpx.post(server.url + "/v1/completions", timeout=30, headers={
                "connection": "close"}, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            error = answer.json()["error"]
            assert (answer.status_code, error["code"]) == (503, "engine_dead"), answer.text
            assert error["message"].lower().count("restart the server") == 1, error
            assert ".." not in error["message"], error
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(40) is not None, server.log()
        assert not [pid for pid in children if running(pid)]
    finally:
        server.kill()
