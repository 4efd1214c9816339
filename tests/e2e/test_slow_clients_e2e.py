"""Issue 26.2 (and the 1 MiB header of 26.7) on real processes: a worker and a router in front
of it, attacked with real slow sockets (a header or a body trickled a byte at a time).

Before the fix the router counted a request in flight before reading its body and nothing timed
out a header or a body, so 8 slow bodies filled `--max-concurrent-requests 4` and every real
client got 429. Now a request counts only once its body is in, slow headers and bodies get a
JSON 408 after the timeout, and a client address past its connection cap gets a JSON 429.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from tests.processes import ServerProcess, deepinfer

pytestmark = pytest.mark.slow

TIMEOUTS = ("--header-timeout-s", "2", "--body-timeout-s", "2")
QUESTION = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0}


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    worker = ServerProcess("worker", deepinfer("serve", "--max-num-seqs", "4", *TIMEOUTS,
                                               "--log-level", "warning"), tmp / "worker.log")
    router = None
    try:
        worker.wait_ready()
        router = ServerProcess("router", deepinfer(
            "router", "--backend", worker.url, "--max-concurrent-requests", "4", *TIMEOUTS,
            "--max-connections-per-client", "40", "--log-level", "warning"), tmp / "router.log")
        router.wait_ready(60)
        yield worker, router
    finally:
        for process in (router, worker):
            if process is not None:
                process.kill()


class SlowSocket:
    """A client that sends `head` at once, then one byte of `tail` every `every_s` seconds, in
    a thread; `answer()` is what the server sent before closing."""

    def __init__(self, url: str, head: bytes, tail: bytes, every_s: float = 0.5) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(head)
        self.received = b""
        self.thread = threading.Thread(target=self._trickle, args=(tail, every_s), daemon=True)
        self.thread.start()

    def _trickle(self, tail: bytes, every_s: float) -> None:
        self.sock.settimeout(every_s)
        for byte in tail:
            try:
                chunk = self.sock.recv(65536)
                if chunk:
                    self.received += chunk
                    break   # the server answered: read the rest below
                return      # closed without an answer
            except socket.timeout:
                pass
            except OSError:
                return
            try:
                self.sock.sendall(bytes([byte]))
            except OSError:
                break
        self.sock.settimeout(5)
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
        except OSError:
            pass

    def answer(self, timeout_s: float = 15) -> bytes:
        self.thread.join(timeout_s)
        self.sock.close()
        return self.received


def slow_body(url: str) -> SlowSocket:
    body = json.dumps(QUESTION).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return SlowSocket(url, head, body)


def slow_header(url: str) -> SlowSocket:
    return SlowSocket(url, b"POST /v1/chat/completions HTTP/1.1\r\n",
                      b"X-Padding: " + b"a" * 200 + b"\r\n")


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.parametrize("target", ["router", "worker"])
def test_slow_clients_do_not_starve_real_ones(processes, target):
    worker, router = processes
    url = (router if target == "router" else worker).url
    attackers = [slow_body(url) for _ in range(8)] + [slow_header(url) for _ in range(8)]
    time.sleep(0.5)   # the slow bodies' headers are in: before the fix they held every slot
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda _: httpx.post(url + "/v1/chat/completions",
                                                     json=QUESTION, timeout=120), range(3)))
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    for attacker in attackers:
        status, error = status_and_error(attacker.answer())
        assert (status, error["code"]) == (408, "request_timeout"), error
        assert "did not arrive within 2 s" in error["message"]


def test_a_client_past_its_connection_cap_gets_429(processes):
    _, router = processes
    host, port = router.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(40)]
    try:
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(5)
        status, error = status_and_error(extra.recv(65536))
        assert (status, error["code"]) == (429, "too_many_connections"), error
        extra.close()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("target", ["router", "worker"])
@pytest.mark.parametrize("size", [70_000, 1 << 20])   # past 64 KiB; h11 alone let 70 kB pass
def test_a_header_over_64_kib_is_a_json_400(processes, target, size):
    worker, router = processes
    url = (router if target == "router" else worker).url
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(10)
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * size
                         + b"\r\n\r\n")
        except OSError:
            pass   # the server answered and closed before reading it all
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status, error = status_and_error(raw)
    assert status == 400
    assert error["code"] == "invalid_http_request" and "headers exceed" in error["message"]


@pytest.mark.parametrize("target", ["router", "worker"])
def test_a_large_body_sent_with_its_header_is_not_a_header_too_large(processes, target):
    """Header and a 200 kB body in one write: only the header counts against the limit."""
    worker, router = processes
    url = (router if target == "router" else worker).url
    body = dict(QUESTION, messages=[{"role": "user", "content": "Hi " + "x" * 200_000}],
                max_tokens=1)
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:   # the prompt may exceed the context; never the header
        assert reply.json()["error"]["code"] != "invalid_http_request", reply.text
