"""`deepinfer router`: the OpenAI-compatible proxy in front of worker replicas.

    deepinfer router --backend http://w1:8000 --backend http://w2:8000 --policy prefix_affinity
    deepinfer router --prefill http://p1:8000 --decode http://d1:8000 --decode http://d2:8000
    deepinfer router --discovery dns --prefill http://deepinfer-prefill-worker-headless:8000 \
        --decode http://deepinfer-decode-worker-headless:8000  # Kubernetes headless Services

`server.cli.main` hands `deepinfer router ...` to `main` here before anything heavy loads; this
module imports FastAPI and uvicorn only when serving, and never torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Any, Sequence

from deepinfer.router.config import DISCOVERY_MODES, POLICY_NAMES, RouterConfig
from deepinfer.server.http_limits import add_limit_flags, limits_from_args, uvicorn_limits

# seconds between ending the relays still running at the drain deadline and uvicorn
# cancelling whatever has not finished
ABORT_MARGIN_S = 5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer router",
        description="Route OpenAI API requests across deepinfer workers: data-parallel "
                    "replicas (--backend), or prefill and decode pools sharing a KV store "
                    "(--prefill/--decode).")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (%(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind (%(default)s)")
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="a worker that serves whole requests, or a pool of them with "
                             "--discovery dns (repeat for each)")
    parser.add_argument("--encoder", action="append", default=[], metavar="URL",
                        help="a --role encoder worker (repeat for each): requests with images "
                             "go encoder -> prefill -> decode (or encoder -> backend); any "
                             "encoder failure falls back to encoding on the next worker")
    parser.add_argument("--encoder-timeout-s", type=float, default=30.0,
                        help="an encoder call's limit, seconds (%(default)s)")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a --role prefill worker or pool (repeat for each)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a --role decode worker or pool (repeat for each)")
    parser.add_argument("--discovery", choices=DISCOVERY_MODES, default=RouterConfig.discovery,
                        help="static: each URL is one worker; dns: each URL names a pool (a "
                             "Kubernetes headless Service) whose host is re-resolved every "
                             "--discovery-interval-s, one worker per A/AAAA address "
                             "(default: %(default)s)")
    parser.add_argument("--discovery-interval-s", type=float,
                        default=RouterConfig.discovery_interval_s,
                        help="seconds between DNS resolutions of each pool (%(default)s)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default=RouterConfig.policy,
                        help="how to pick a replica (default: %(default)s)")
    parser.add_argument("--max-imbalance", type=int, default=RouterConfig.max_imbalance,
                        help="prefix_affinity's load guard: skip the preferred replica when "
                             "it has more than this many requests above the least-loaded one "
                             "(default: %(default)s)")
    parser.add_argument("--health-interval-s", type=float, default=RouterConfig.health_interval_s,
                        help="seconds between health checks of each worker (%(default)s)")
    parser.add_argument("--health-timeout-s", type=float, default=RouterConfig.health_timeout_s,
                        help="a health check slower than this fails (%(default)s)")
    parser.add_argument("--max-failures", type=int, default=RouterConfig.max_failures,
                        help="failed checks in a row that eject a worker (%(default)s)")
    parser.add_argument("--max-concurrent-requests", type=int,
                        default=RouterConfig.max_concurrent_requests,
                        help="requests in flight before new ones get HTTP 429 (%(default)s)")
    parser.add_argument("--connect-timeout-s", type=float, default=RouterConfig.connect_timeout_s,
                        help="connect timeout to a worker (%(default)s)")
    parser.add_argument("--request-timeout-s", type=float, default=RouterConfig.request_timeout_s,
                        help="longest wait for a worker's next byte (%(default)s)")
    parser.add_argument("--stream-stall-timeout-s", type=float,
                        default=RouterConfig.stream_stall_timeout_s,
                        help="a stream whose worker sends no byte for this long (a hung "
                             "worker) is ended with an SSE error event `stream_stalled` and "
                             "[DONE] (%(default)s)")
    parser.add_argument("--max-attempts", type=int, default=RouterConfig.max_attempts,
                        help="workers tried when connections fail before the answer "
                             "(%(default)s)")
    parser.add_argument("--graceful-shutdown-s", type=int, default=30,
                        help="on SIGTERM, how long relayed requests (streams included) may run "
                             "before they are cut (%(default)s)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes and the API "
                             "docs (default: $DEEPINFER_ROUTER_API_KEY; unset = open). A flag "
                             "shows in `ps`: prefer the variable or --api-key-file")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the router's API keys from PATH, one per line")
    add_limit_flags(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig the flags describe; raises ValueError with a fix in the message."""
    return RouterConfig(
        backends=tuple(args.backend), prefill=tuple(args.prefill), decode=tuple(args.decode),
        encoders=tuple(args.encoder), encoder_timeout_s=args.encoder_timeout_s,
        policy=args.policy, max_imbalance=args.max_imbalance,
        health_interval_s=args.health_interval_s, health_timeout_s=args.health_timeout_s,
        max_failures=args.max_failures, max_concurrent_requests=args.max_concurrent_requests,
        connect_timeout_s=args.connect_timeout_s, request_timeout_s=args.request_timeout_s,
        max_attempts=args.max_attempts, discovery=args.discovery,
        stream_stall_timeout_s=args.stream_stall_timeout_s,
        discovery_interval_s=args.discovery_interval_s)


def router_api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None
                    ) -> tuple[str, ...]:
    """--api-key (else $DEEPINFER_ROUTER_API_KEY) plus the lines of --api-key-file.

    Raises:
        ValueError: a key set but empty, or a file unreadable or without a key.
    """
    import os

    environ = os.environ if environ is None else environ
    key = args.api_key if args.api_key is not None else environ.get("DEEPINFER_ROUTER_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("the router's API key is set but empty; give the key, or unset it to "
                         "serve without authentication")
    keys = [key.strip()] if key is not None else []
    if args.api_key_file:
        try:
            lines = open(args.api_key_file, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") \
                from None
        found = [line.strip() for line in lines
                 if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key; put one key "
                             "per line")
        keys.extend(found)
    return tuple(keys)


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (taken, not a local address), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        limits = limits_from_args(args)
        keys = router_api_keys(args)
        if args.graceful_shutdown_s < 0:
            raise ValueError(f"--graceful-shutdown-s {args.graceful_shutdown_s} must be >= 0")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
        if reason := _cannot_listen(args.host, args.port):
            raise ValueError(f"cannot listen on {args.host}:{args.port} ({reason}); pick "
                             "another --port or --host")
    except ValueError as exc:
        print(f"deepinfer router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: with health checks every few seconds per replica that
    # buries the router's own lines (admissions, ejections); shown with --log-level debug
    if args.log_level.lower() != "debug":
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    import uvicorn

    from deepinfer.router.app import CLIENT_KEEP_ALIVE_S, build_app

    mode = (f"prefill {list(config.prefill)} -> decode {list(config.decode)}"
            if config.disaggregated else f"backends {list(config.backends)}")
    if config.discovery == "dns":
        mode += f" (DNS pools, re-resolved every {config.discovery_interval_s:g} s)"
    print(f"deepinfer router: http://{args.host}:{args.port}/v1 -> {mode}, policy "
          f"{config.policy}", flush=True)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal it caught: these no-op
    # handlers receive it, so the router exits 0 after a clean drain
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    app = build_app(config, limits=limits, api_keys=keys)
    # uvicorn cuts what still runs ABORT_MARGIN_S after our own deadline, by which time every
    # relay has ended with a proper answer (see _serve)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_s + ABORT_MARGIN_S,
        timeout_keep_alive=CLIENT_KEEP_ALIVE_S, **uvicorn_limits(limits)))
    asyncio.run(_serve(server, app.state.proxy, args.graceful_shutdown_s))
    print("deepinfer router: stopped", flush=True)
    return 0


async def _serve(server: Any, proxy: Any, drain_s: float) -> None:
    async def end_relays_after_drain() -> None:
        """Once shutdown starts, give relays `drain_s` seconds, then end those still running:
        a request still waiting for its worker answers 503 `router_shutting_down`, a stream
        gets that error event and `[DONE]` (instead of being cut by uvicorn)."""
        while not server.should_exit:
            await asyncio.sleep(0.1)
        await asyncio.sleep(drain_s)
        proxy.drain_over.set()

    deadline = asyncio.create_task(end_relays_after_drain())
    try:
        await server.serve()
    finally:
        deadline.cancel()


if __name__ == "__main__":
    sys.exit(main())
