"""uvicorn serving one app until drained: `serve_http`, used by `deepinfer serve`
(server/cli.py) and by each API server process of several (server/api_servers.py).

On SIGTERM or Ctrl-C the server drains: it keeps listening and serving while its in-flight
requests finish (up to --graceful-shutdown-s; those still running then answer 503), /health
answers 503 `{"status": "draining"}` so a router sends nothing new without cancelling what runs;
at zero in flight uvicorn stops. A second signal stops at once: the requests still running
answer that 503 right away and uvicorn exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from typing import Any

from deepinfer.server.http_limits import limits_from_args, uvicorn_limits

# Idle keep-alive connections are closed after this many seconds: longer than the router's pool
# keeps them (router.app.WORKER_IDLE_EXPIRY_S) and than common load balancers' idle timeouts
# (60 s), so a client never sends on a connection the server is closing (uvicorn's default, 5 s,
# races the default pool expiry of most clients).
KEEP_ALIVE_S = 75


# seconds between aborting the requests still running at the drain deadline (they answer 503)
# and uvicorn cancelling whatever has not answered
ABORT_MARGIN_S = 5


async def _drain(server: Any, app: Any, drain_s: float) -> None:
    """Once a signal starts the drain, wait until no request is in flight or `drain_s` seconds
    passed; then abort those still running (each answers an OpenAI-style 503
    `server_shutting_down`, a stream an SSE error event then `[DONE]`, instead of being cut by
    uvicorn with a bare 500) and let uvicorn stop."""
    while not (server.draining or server.should_exit):
        await asyncio.sleep(0.1)
    start = time.monotonic()
    # a second signal ends the wait: what still runs is aborted now, so uvicorn, which
    # stops on that signal, has nothing left to wait for
    while (app.state.in_flight > 0 and time.monotonic() < start + drain_s
           and not server.signalled_twice):
        await asyncio.sleep(0.1)
    reason = ("the server was stopped by a second signal during its drain."
              if server.signalled_twice else
              f"it ran past the {drain_s:g} s drain (--graceful-shutdown-s).")
    aborted = app.state.engine.abort_all(reason)
    if aborted:
        logging.getLogger("deepinfer.server").warning(
            "shutdown: aborted %d request(s) still running after %.1f s",
            aborted, time.monotonic() - start)
    server.should_exit = True


def draining_server(config: Any, *, ignore_sigint: bool = False) -> Any:
    """A uvicorn.Server whose first SIGTERM/SIGINT starts a drain (`_drain`) instead of
    closing the listener: a router health-checking it sees "draining", not a dead worker.
    `ignore_sigint`: one of several API servers (server.api_servers), whose launcher turns a
    terminal's Ctrl-C (sent to the whole process group) into one SIGTERM each."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        draining = False
        signalled_twice = False   # a signal came during the drain: `_drain` stops waiting

        def handle_exit(self, sig: int, frame: Any) -> None:
            if ignore_sigint and sig == signal.SIGINT:
                return
            if not self.draining and not self.should_exit:
                self._captured_signals.append(sig)   # re-raised by uvicorn at the end
                self.draining = True
                config.app.state.draining = True
                return
            self.signalled_twice = self.draining
            super().handle_exit(sig, frame)

    return DrainingServer(config)


async def serve_http(app: Any, args: argparse.Namespace, *, sock: Any = None,
                     announce: bool = True, launcher_pid: int | None = None) -> None:
    """uvicorn serving `app` until drained (see `_drain`).

    sock: a listening socket shared with other API server processes (server.api_servers),
        whose launcher has pid `launcher_pid` (gone: stop); None binds --host/--port.
    announce: print the "serving at" line (one API server of several does).
    """
    import uvicorn

    # uvicorn cuts what still runs ABORT_MARGIN_S after our own deadline, by which time every
    # request has had its proper error answer (see _abort_after_drain)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_shutdown_s + ABORT_MARGIN_S,
                            timeout_keep_alive=KEEP_ALIVE_S,
                            **uvicorn_limits(limits_from_args(args)))
    server = draining_server(config, ignore_sigint=sock is not None)
    serving = asyncio.create_task(server.serve(sockets=[sock] if sock is not None else None))
    deadline = asyncio.create_task(_drain(server, app, args.graceful_shutdown_s))
    serving.add_done_callback(lambda _: deadline.cancel())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started and announce:
        url = f"http://{args.host}:{args.port}"
        count = app.state.engine.config.frontend.api_server_count if sock is not None else 1
        print(f"deepinfer: serving {app.state.engine.model_name!r} at {url}/v1 "
              f"(health: {url}/health, metrics: {url}/metrics"
              f"{f'; {count} API server processes' if count > 1 else ''})", flush=True)
    while launcher_pid is not None and not serving.done():
        if os.getppid() != launcher_pid:   # the launcher is gone: do not serve on alone
            server.should_exit = True
        await asyncio.sleep(1.0)
    await serving
