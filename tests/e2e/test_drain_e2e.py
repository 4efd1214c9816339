"""Issue 26.4 on real processes: SIGTERM to a worker behind the router while non-streamed
requests run on it. The worker keeps listening and answers /health with 503 "draining"; the
router stops sending it new requests but cancels none, so every request completes (before the
fix the worker closed its listener, the router ejected it on connection refused and cancelled
the requests whose answer had not begun: 503 after 0.8 s for requests needing 2.4 s)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import time

import httpx
import pytest

from tests.processes import ServerProcess, deepinfer, metric

pytestmark = pytest.mark.slow

BODY = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 256,
        "ignore_eos": True, "temperature": 0}


@contextlib.contextmanager
def worker_behind_router(tmp_path, worker_args: tuple[str, ...], router_args: tuple[str, ...]):
    """(worker, router) processes, the router in front of the worker; both killed after (the
    worker continued first, in case a test stopped it)."""
    worker = ServerProcess("worker", deepinfer("serve", *worker_args), tmp_path / "worker.log")
    router = None
    try:
        worker.wait_ready()
        router = ServerProcess("router", deepinfer("router", "--backend", worker.url,
                                                   *router_args),
                               tmp_path / "router.log").wait_ready(60)
        yield worker, router
    finally:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGCONT)
        for process in (router, worker):
            if process is not None:
                process.kill()


def test_a_draining_worker_finishes_every_non_streamed_request(tmp_path):
    with worker_behind_router(tmp_path, ("--max-num-seqs", "4", "--graceful-shutdown-s", "120"),
                              ("--health-interval-s", "0.5")) as (worker, router):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(httpx.post, router.url + "/v1/chat/completions", json=BODY,
                                   timeout=300) for _ in range(3)]
            deadline = time.monotonic() + 60
            while metric(worker.url, "deepinfer:num_requests_running") < 3:
                assert time.monotonic() < deadline, worker.log()
                time.sleep(0.05)
            worker.proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)   # three health checks: the router knows it is draining
            health = httpx.get(worker.url + "/health", timeout=10)
            assert (health.status_code, health.json()["status"]) == (503, "draining")
            assert httpx.get(router.url + "/health", timeout=10).status_code == 503
            replies = [f.result() for f in futures]
        assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
        assert [r.json()["usage"]["completion_tokens"] for r in replies] == [256] * 3
        assert worker.proc.wait(timeout=60) == 0
        assert "deepinfer: stopped" in worker.log()
        # ejected only once gone (connection refused after its exit), never while it drained
        assert "was ejected before answering" not in router.log()


def test_a_hung_worker_ends_the_stream_with_an_error_event(tmp_path):
    """Issue 26.5: a worker that stops responding mid-stream (SIGSTOP) used to leave the
    client's stream silent for up to the 600 s request timeout; the router now ends it after
    --stream-stall-timeout-s with an error event the client can act on, then [DONE]."""
    import json

    with worker_behind_router(tmp_path, ("--max-num-seqs", "2"),
                              ("--stream-stall-timeout-s", "3")) as (worker, router):
        lines: list[str] = []
        stopped_at = None
        with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=120,
                          json={**BODY, "max_tokens": 2000, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3 and stopped_at is None:
                    worker.proc.send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        waited_s = time.monotonic() - stopped_at
        assert 2.5 < waited_s < 20, (waited_s, lines[-4:])
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["code"] == "stream_stalled" and "sent nothing for 3 s" in error["message"]
