"""`deepinfer serve --api-server-count N`: N HTTP API server processes, one engine core.

Processes (vLLM v1's layout; our code):
- the launcher (the `deepinfer serve` process): binds the port (one SO_REUSEPORT socket per
  API server, see `_listen`), starts the engine core process (engine/core_proc.py) and N API
  server processes, forwards SIGTERM / Ctrl-C to the API servers, stops the core after
  them, and cleans its directories up;
- each API server: uvicorn on its socket (the kernel spreads new connections over the
  sockets), FastAPI, tokenization, detokenization and SSE; an
  `MPAsyncLLM` client of the core (engine/core_client.py) with its own pair of ZeroMQ
  sockets, so the core sends each API server the outputs of the requests it sent;
- the engine core: scheduler, model, KV cache (and, with data parallelism, one worker per
  rank, its children).

Metrics: prometheus_client's multiprocess mode over a private directory
(`PROMETHEUS_MULTIPROC_DIR`, made at start and removed at exit): /metrics from any API server
counts every API server's requests; the engine's stats come once, from the core.

Drain: a first SIGTERM (or SIGINT) makes every API server drain as one `deepinfer serve`
does (server/cli.py: /health answers "draining", in-flight requests finish, then it exits and
tells the core it is done); the core stops when all have. A second signal stops them at once.
An API server that dies unexpectedly stops the others (exit status 1); a core that dies leaves
the API servers answering 503 `engine_dead`, as with one API server.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for
from typing import Any

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core_wire import CoreEndpoints
from deepinfer.server.http_limits import HTTPLimits

logger = logging.getLogger("deepinfer.server")

LISTEN_BACKLOG = 4096      # connections queued on the shared socket before one is accepted
CORE_STOP_S = 30.0         # after the API servers exit, how long the core may take to stop
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class APIServerSpec:
    """What API server `index` needs (pickled into its spawned process)."""

    index: int
    args: argparse.Namespace      # the `deepinfer serve` flags (uvicorn and drain settings)
    config: EngineConfig          # the model already resolved (engine.core_client.core_config)
    endpoints: CoreEndpoints
    api_keys: tuple[str, ...]
    limits: HTTPLimits
    metrics_dir: str
    launcher_pid: int


def run_api_server(spec: APIServerSpec, sock: socket.socket) -> None:
    """An API server process's entry point: connect to the core, serve on `sock`, drain."""
    from deepinfer.engine.async_llm import freeze_startup_heap
    from deepinfer.engine.core_client import MPAsyncLLM
    from deepinfer.server.app import build_app
    from deepinfer.server.http_serve import serve_http

    args = spec.args
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api{spec.index}]: "
                               "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the launcher forwards Ctrl-C as SIGTERM
    signal.signal(signal.SIGTERM, lambda signum, _: os._exit(128 + signum))  # while starting
    engine = MPAsyncLLM(spec.config, endpoints=spec.endpoints, client_index=spec.index)
    signal.signal(signal.SIGTERM, lambda *_: None)   # uvicorn's handlers take over (drain)
    app = build_app(engine, api_key=spec.api_keys, cache_isolation=args.cache_isolation,
                    limits=spec.limits, media=spec.config.multimodal,
                    api_server_index=spec.index, metrics_dir=spec.metrics_dir)
    freeze_startup_heap()
    try:
        asyncio.run(serve_http(app, args, sock=sock, announce=spec.index == 0,
                               launcher_pid=spec.launcher_pid))
    finally:
        engine.shutdown()


class APIServers:
    """The launcher's processes. `start()`, then `wait()` (blocks until the API servers have
    exited, forwarding signals), `close()` in any case (stops what still runs, removes the
    directories). The benchmark drives it with `stop()` instead of a signal.

    Args:
        config: the engine configuration; `config.frontend.api_server_count` processes.
        args: the `deepinfer serve` flags (host, port, log level, drain, limits).
        api_keys: the accepted keys (server.cli.api_keys), empty for an open API.
        limits: the HTTP limits (server.http_limits).
        model_factory: builds the model in the core (benchmarks: random weights).
    """

    def __init__(self, config: EngineConfig, args: argparse.Namespace, *,
                 api_keys: tuple[str, ...] = (), limits: HTTPLimits = HTTPLimits(),
                 model_factory: Callable | None = None) -> None:
        self.config, self.args = config, args
        self.api_keys, self.limits = api_keys, limits
        self.model_factory = model_factory
        self.count = config.frontend.api_server_count
        self.servers: list[Any] = []
        self.core: Any = None
        self.signals = 0
        self._dirs: list[str] = []

    def start(self) -> None:
        from deepinfer.engine.core_client import core_config, start_core_process

        context = multiprocessing.get_context("spawn")
        socks = [_listen(self.args.host, self.args.port, reuse_port=self.count > 1)
                 for _ in range(self.count)]
        metrics_dir = self._mkdtemp("deepinfer-metrics-")
        ipc_dir = self._mkdtemp("deepinfer-core-")
        config = core_config(self.config)
        self.core = start_core_process(config, CoreEndpoints(ipc_dir, self.count),
                                       self.model_factory)
        endpoints = CoreEndpoints(ipc_dir, self.count, self.core.pid)
        # prometheus_client reads the variable when an API server first imports it
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        try:
            for index in range(self.count):
                spec = APIServerSpec(index, self.args, config, endpoints, self.api_keys,
                                     self.limits, metrics_dir, os.getpid())
                server = context.Process(target=run_api_server, args=(spec, socks[index]),
                                         name=f"deepinfer-api-server-{index}", daemon=False)
                server.start()
                self.servers.append(server)
        finally:
            if previous is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
            for sock in socks:
                sock.close()   # the API servers hold their own copies

    def stop(self, *_: Any) -> None:
        """Start the drain (first call) or stop at once (later calls): SIGTERM to every API
        server still running. Also the launcher's SIGTERM/SIGINT handler."""
        self.signals += 1
        for server in self.servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    def wait(self) -> int:
        """Block until every API server has exited. Returns the exit status: 0 after a
        drain, 1 when an API server died unasked (the others are then stopped)."""
        status, core_gone = 0, False
        while any(server.is_alive() for server in self.servers):
            sentinels = [s.sentinel for s in self.servers]
            ready = wait_for(sentinels if core_gone else sentinels + [self.core.sentinel],
                             POLL_S)
            if not core_gone and self.core.sentinel in ready:
                core_gone = True
                self.core.join()   # reaped: its pid disappears, which the API servers notice
                if not self.signals:
                    logger.error("the engine core exited (code %s); the API servers answer "
                                 "503 until the server is restarted", self.core.exitcode)
            for server in self.servers:
                if server.exitcode not in (None, 0) and not self.signals and not status:
                    logger.error("API server %s exited with %s; stopping the others",
                                 server.name, server.exitcode)
                    status = 1
                    self.stop()
        return status

    def close(self) -> None:
        """Stop whatever still runs (API servers, then the core) and remove the directories."""
        for server in self.servers:
            server.join(5 if server.is_alive() else 0)
            if server.is_alive():
                server.kill()
                server.join(5)
        if self.core is not None:
            # it stops once every API server said it is done; one that did not exit cleanly
            # never will
            clean = all(server.exitcode == 0 for server in self.servers)
            self.core.join(CORE_STOP_S if clean else 2.0)
            if self.core.is_alive():
                logger.warning("the engine core did not stop within %g s; killing it",
                               CORE_STOP_S)
                self.core.kill()
                self.core.join(5)
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)

    def _mkdtemp(self, prefix: str) -> str:
        path = tempfile.mkdtemp(prefix=prefix)
        self._dirs.append(path)
        return path


def _listen(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """One API server's listening socket (handed to its spawned process as a duplicated
    descriptor). With `reuse_port` every API server has its own socket on the one port
    (SO_REUSEPORT) and the kernel spreads new connections over them by a hash of their
    addresses. Chosen over one socket shared by all (vLLM's way): asyncio's and uvloop's
    accept loops take every queued connection on one wake-up, so the process that woke
    first took most of a burst (CPU, 4 API servers, 128 streams at once: 86/42/0/0 and
    57/45/23/3 streams); with SO_REUSEPORT the split follows the hash (see RESULTS.md)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def serve_api_servers(config: EngineConfig, args: argparse.Namespace,
                      api_keys: tuple[str, ...], limits: HTTPLimits) -> int:
    """`deepinfer serve` with `config.frontend.api_server_count` > 1; the exit status."""
    servers = APIServers(config, args, api_keys=api_keys, limits=limits)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, servers.stop)
    started = time.monotonic()
    try:
        servers.start()
        status = servers.wait()
    finally:
        servers.close()
    logger.info("all %d API servers stopped after %.0f s", servers.count,
                time.monotonic() - started)
    print("deepinfer: stopped", flush=True)
    return status
