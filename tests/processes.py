"""Real server processes for e2e tests and benchmarks: start, wait for /health, read the log,
kill the process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepinfer(*args: str) -> Callable[[int], list[str]]:
    """The command line `deepinfer ARGS --port P` (run as `python -m server.cli`)."""
    return lambda port: [sys.executable, "-m", "deepinfer.server.cli", *args, "--port", str(port)]


class ServerProcess:
    """`command(port)` run in its own process group on a free port, output to `log_path`.

    Args:
        name: for error messages.
        command: port -> argv.
        log_path: the process's stdout and stderr.
        env: extra environment variables.
    """

    def __init__(self, name: str, command: Callable[[int], list[str]], log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(command(self.port), cwd=ROOT,
                                     env={**os.environ, **(env or {})}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 900) -> "ServerProcess":
        """Block until GET /health answers 200 (the first run on a machine converts the GGUF
        model and builds the C++ kernels, hence the long default).

        Raises:
            RuntimeError: the process exited, or is not healthy after timeout_s; with its log.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s}s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, scraped from
    `url`/metrics (a worker or a router)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def sigterm_during(process: ServerProcess, body: dict, *, plain: bool = False,
                   path: str = "/v1/chat/completions", timeout_s: float = 120,
                   in_flight: Callable[[], bool] | None = None, signals: int = 1
                   ) -> tuple[list[str], httpx.Response | None]:
    """POST `body` streamed (and, with `plain`, also not streamed) to `process`, send SIGTERM
    (`signals` times, 0.5 s apart) once the stream's first event arrived and `in_flight()` (if
    given) is true, and wait for both answers to end. With `plain`, pass an `in_flight` that
    sees the plain request taken (otherwise it may not have connected before the SIGTERM stops
    the listener).

    Returns:
        (the stream's non-empty lines, the plain answer or None).
    """
    import threading

    lines: list[str] = []
    answers: list[httpx.Response] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", process.url + path, json={**body, "stream": True},
                          timeout=timeout_s) as reply:
            for line in reply.iter_lines():
                if line:
                    lines.append(line)
                    streaming.set()

    readers = [threading.Thread(target=stream)]
    if plain:
        readers.append(threading.Thread(target=lambda: answers.append(
            httpx.post(process.url + path, json=body, timeout=timeout_s))))
    for reader in readers:
        reader.start()
    assert streaming.wait(60), f"{process.name} streamed nothing:\n{process.log()}"
    deadline = time.monotonic() + 60
    while in_flight is not None and not in_flight():
        assert time.monotonic() < deadline, f"{process.name}: requests not in flight"
        time.sleep(0.05)
    for index in range(signals):
        if index:
            time.sleep(0.5)
        process.proc.send_signal(signal.SIGTERM)
    for reader in readers:
        reader.join(timeout_s)
    return lines, (answers[0] if answers else None)


def child_pids(pid: int) -> list[int]:
    """Pids of `pid`'s child processes (scanned from /proc), multiprocessing's resource
    tracker left out."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            if parent == pid and b"resource_tracker" not in (entry / "cmdline").read_bytes():
                kids.append(int(entry.name))
        except OSError:
            continue
    return kids


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may reap late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
