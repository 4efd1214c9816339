"""`deepinfer serve [MODEL]`: load the model, serve the OpenAI API, shut down gracefully.

The engine config is built as defaults <- `DEEPINFER_*` environment variables <- the flags the
user gave (a flag left out never overrides the environment). The engine is imported only when
serving, so `deepinfer --help` starts in a blink without torch.

On SIGTERM or Ctrl-C the server drains: it keeps listening and serving while its in-flight
requests finish (up to --graceful-shutdown-s; those still running then answer 503), /health
answers 503 `{"status": "draining"}` so a router sends nothing new without cancelling what runs;
at zero in flight uvicorn stops, then the engine's step loop. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any, Sequence

from deepinfer.server.http_limits import add_limit_flags, limits_from_args
from deepinfer.server.http_serve import ABORT_MARGIN_S, KEEP_ALIVE_S, serve_http

__all__ = ["ABORT_MARGIN_S", "KEEP_ALIVE_S", "build_engine_config", "build_parser", "main",
           "serve"]

def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="serve a model through the OpenAI API",
        description="Serve one model through an OpenAI-compatible HTTP API. Engine flags left "
                    "out take their DEEPINFER_* environment variable, then the default.")
    keep = argparse.SUPPRESS  # engine flags the user did not give stay out of the namespace
    serve.add_argument("model", nargs="?", default=keep,
                       help="HF model directory or .gguf file (default: the embedded "
                            "SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    serve.add_argument("--max-model-len", type=int, default=keep,
                       help="context window in tokens (default: the model's, capped by the KV "
                            "cache)")
    serve.add_argument("--max-num-seqs", type=int, default=keep,
                       help="requests running in one step (default 32)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=keep,
                       help="token budget of one step (default 512)")
    serve.add_argument("--block-size", type=int, default=keep, help="tokens per KV block (16)")
    serve.add_argument("--num-kv-blocks", type=int, default=keep,
                       help="KV cache size in blocks (default: from --kv-cache-memory-gb)")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=keep,
                       help="memory for the KV cache in GiB (default: 1 on CPU; on CUDA what "
                            "--gpu-memory-utilization leaves after weights and activations)")
    serve.add_argument("--gpu-memory-utilization", type=float, default=keep,
                       help="share of the GPU's memory the engine may use (default 0.9)")
    serve.add_argument("--enforce-eager", action="store_true", default=keep,
                       help="on CUDA, no CUDA graphs: every step runs eagerly")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                       default=keep, help="weights and activations dtype (default auto)")
    serve.add_argument("--device", default=keep, help="auto, cpu, cuda or cuda:N (default auto)")
    serve.add_argument("--structured-outputs-backend", choices=["auto", "xgrammar", "guidance"],
                       default=keep, help="grammar backend of structured outputs and tool "
                       "calls: auto (XGrammar when it enforces every keyword of the schema, "
                       "else LLGuidance), xgrammar or guidance (default auto)")
    serve.add_argument("--served-model-name", default=keep,
                       help="the model name clients send (default: derived from MODEL)")
    serve.add_argument("--seed", type=int, default=keep,
                       help="base seed for requests that give none (default: random)")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=keep,
                       help="prepare the next step on the host while the device runs this one "
                            "(default: on for CUDA, off for CPU)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=keep,
                       help="run the engine core (scheduler, model) in its own process, apart "
                            "from the HTTP server's event loop (default: on for CUDA, off for "
                            "CPU)")
    serve.add_argument("--api-server-count", type=int, default=keep, metavar="N",
                       help="HTTP API server processes on the one port, each a client of "
                            "the one engine core process (as vLLM's); more than 1 turns "
                            "--engine-process on and refuses --no-engine-process (default 1)")
    serve.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=keep,
                       help="batch-invariant inference: a request's tokens and logprobs do not "
                            "depend on what else is batched (Llama-family models; DeepSeek on "
                            "CUDA; slower; README 'Deterministic serving'; default off)")
    serve.add_argument("--max-waiting-requests", type=int, default=keep,
                       help="queued requests before new ones get HTTP 429 (default 256)")
    serve.add_argument("--data-parallel-size", type=int, default=keep, metavar="N",
                       help="attention data parallelism: N worker processes, each with its own "
                            "requests and KV cache (default 1)")
    serve.add_argument("--enable-expert-parallel", action="store_true", default=keep,
                       help="split MoE routed experts over the ranks (all-to-all dispatch)")
    serve.add_argument("--enable-eplb", action="store_true", default=keep,
                       help="rebalance expert placement from recent routing loads (EPLB)")
    serve.add_argument("--num-redundant-experts", type=int, default=keep, metavar="R",
                       help="extra physical expert slots per MoE layer for EPLB (default 0)")
    serve.add_argument("--role", choices=["both", "prefill", "decode", "encoder"], default=keep,
                       help="prefill/decode disaggregation: 'prefill' stores prompt KV blocks for "
                            "a decode worker, 'decode' loads them; 'encoder' runs only a "
                            "vision-language model's image encoder and stores embeddings "
                            "(default both)")
    serve.add_argument("--mm-encoder-cache-gb", type=float, default=keep,
                       help="memory for encoded images kept by content hash, GiB (default 0.25)")
    serve.add_argument("--max-images-per-request", type=int, default=keep,
                       help="more image parts in one request are a 400 (default 8)")
    serve.add_argument("--max-image-bytes", type=int, default=keep,
                       help="an image's size cap in bytes, inline or downloaded (default 20 MiB)")
    serve.add_argument("--allow-remote-media", action=argparse.BooleanOptionalAction,
                       default=keep, help="fetch http(s) image URLs (default on; off: data "
                                          "URLs only)")
    serve.add_argument("--allowed-media-domains", default=keep, metavar="HOSTS",
                       help="comma-separated hosts remote images may come from, subdomains "
                            "included (default: any)")
    serve.add_argument("--media-fetch-timeout-s", type=float, default=keep,
                       help="a remote image's download limit in seconds (default 10)")
    serve.add_argument("--allow-private-media-hosts", action=argparse.BooleanOptionalAction,
                       default=keep, help="also fetch images from hosts that resolve to "
                                          "loopback/private/link-local addresses (default off: "
                                          "SSRF protection)")
    serve.add_argument("--kv-store", default=keep, metavar="URL",
                       help="KV block store shared as a prefix cache: memory (in-process, the "
                            "default), none, redis://[:password@]host:port/db or rediss://... "
                            "(a password in a flag shows in `ps`: set DEEPINFER_KV_STORE "
                            "instead)")
    serve.add_argument("--kv-store-memory-gb", type=float, default=keep,
                       help="byte cap of the memory KV store in GiB (default 1)")
    serve.add_argument("--kv-store-ttl-s", type=int, default=keep,
                       help="expiry of blocks stored in Redis, seconds; 0 = never (default 86400)")
    _add_speculative_flags(serve, keep)
    _add_multinode_flags(serve, keep)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes and the API "
                            "docs (default: $DEEPINFER_API_KEY; unset = no authentication; "
                            "empty is refused). A flag shows in `ps`: prefer the variable or "
                            "--api-key-file")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read API keys from PATH, one per line ('#' comments): each "
                            "client may get its own (see --cache-isolation api-key)")
    serve.add_argument("--cache-isolation", choices=["none", "user", "api-key"],
                       default="none",
                       help="prefix-cache and KV-store sharing between requests: 'none' "
                            "shares cached prompt blocks between all requests (fastest; "
                            "cached_tokens then tells a client whether a prefix was seen); "
                            "'user' salts them by the request's `user` field, 'api-key' by "
                            "the bearer token, so users cannot probe each other's prompts; a "
                            "request's own `cache_salt` is always honoured (default: "
                            "%(default)s)")
    serve.add_argument("--graceful-shutdown-s", type=int, default=30,
                       help="on SIGTERM, how long in-flight requests may run (default 30)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    add_limit_flags(serve)


def _add_multinode_flags(serve: argparse.ArgumentParser, keep: Any) -> None:
    """Data/expert parallelism over several nodes (ParallelConfig, engine/dp_node.py): torchrun's
    names, with vLLM's where it has one."""
    serve.add_argument("--headless", action="store_true",
                       help="a node other than 0: run this node's ranks only (no API server, "
                            "no engine core); they join node 0's engine core")
    serve.add_argument("--nnodes", type=int, default=keep, metavar="N",
                       help="nodes the ranks span (default 1)")
    serve.add_argument("--node-rank", type=int, default=keep,
                       help="this node's index; 0 runs the API server (default 0)")
    serve.add_argument("--master-addr", "--data-parallel-address", dest="master_addr",
                       default=keep, metavar="ADDR",
                       help="node 0's address: the ranks' rendezvous and the engine core's "
                            "control port (default 127.0.0.1)")
    serve.add_argument("--master-port", type=int, default=keep,
                       help="the ranks' rendezvous port (torch.distributed; default: a free "
                            "one, which needs fixing with several nodes)")
    serve.add_argument("--data-parallel-rpc-port", type=int, default=keep,
                       help="node 0's port for the other nodes' ranks (their steps); needed "
                            "with several nodes, with DEEPINFER_DP_RPC_SECRET set alike")
    serve.add_argument("--data-parallel-size-local", type=int, default=keep, metavar="L",
                       help="ranks on this node (default: --data-parallel-size / --nnodes)")
    serve.add_argument("--data-parallel-start-rank", type=int, default=keep,
                       help="this node's first rank (default: --node-rank x ranks per node)")
    serve.add_argument("--ep-backend", choices=["auto", "all_to_all", "deep_ep"],
                       default=keep, help="expert-parallel dispatch/combine: all_to_all "
                       "(torch.distributed), deep_ep (DeepEP, CUDA, when installed) or auto "
                       "(default)")


def _add_speculative_flags(serve: argparse.ArgumentParser, keep: Any) -> None:
    """Speculative decoding (engine/spec/, SpeculativeConfig)."""
    serve.add_argument("--speculative-method", choices=["ngram", "mtp", "draft_model"],
                       default=keep, help="draft tokens and verify them in one step: ngram "
                       "(prompt lookup, any model), mtp (DeepSeek MTP module) or draft_model "
                       "(default: off)")
    serve.add_argument("--num-speculative-tokens", type=int, default=keep,
                       help="the most drafts a request verifies per step (default 5)")
    serve.add_argument("--spec-varlen", action=argparse.BooleanOptionalAction, default=keep,
                       help="DSpark confidence-scheduled verification: verify the drafts whose "
                       "expected acceptance pays for the slower step (default on); "
                       "--no-spec-varlen verifies --num-speculative-tokens per request")
    serve.add_argument("--speculative-model", default=keep, metavar="DIR",
                       help="the draft model of --speculative-method draft_model")
    serve.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="vLLM's spelling: '{\"method\": \"ngram\", "
                       "\"num_speculative_tokens\": 5}' (also model, prompt_lookup_min, "
                       "prompt_lookup_max); a --speculative-* flag may repeat a value, not change it")


# --speculative-config JSON key -> SpeculativeConfig field
_SPECULATIVE_CONFIG_KEYS = {"method": "speculative_method",
                            "num_speculative_tokens": "num_speculative_tokens",
                            "model": "speculative_model", "prompt_lookup_min": "prompt_lookup_min",
                            "prompt_lookup_max": "prompt_lookup_max",
                            "spec_varlen": "spec_varlen"}


def speculative_config_fields(text: str) -> dict:
    """SpeculativeConfig fields of a --speculative-config JSON object.

    Raises:
        ValueError: not a JSON object, or a key it does not know (the message lists them).
    """
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not valid JSON ({exc.msg}); give an object "
                         "such as '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'"
                         ) from None
    if not isinstance(parsed, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'")
    unknown = sorted(set(parsed) - set(_SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {unknown}; known: "
                         f"{sorted(_SPECULATIVE_CONFIG_KEYS)}")
    if parsed.get("method") is None:
        raise ValueError("--speculative-config needs a \"method\" (ngram, mtp or draft_model), "
                         "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'; "
                         "without one, drop the flag")
    return {_SPECULATIVE_CONFIG_KEYS[key]: value for key, value in parsed.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer",
                                     description="deepinfer: an OpenAI-compatible LLM server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_parser(commands)
    # `deepinfer router ...` is handed to router.cli before this parser runs (see main); the
    # entry here only lists it in `deepinfer --help`.
    commands.add_parser("router", add_help=False,
                        help="route requests across workers (deepinfer router --help)")
    return parser


def engine_sections(args: argparse.Namespace,
                    environ: dict[str, str] | None = None) -> dict[str, dict]:
    """`EngineConfig.replace` sections: environment overrides, then the flags given."""
    from deepinfer.engine.config import engine_flags, env_overrides

    sections = env_overrides(environ)
    from_json = (speculative_config_fields(args.speculative_config)
                 if getattr(args, "speculative_config", None) is not None else {})
    sections.setdefault("speculative", {}).update(from_json)
    for dest, (section, field, convert) in engine_flags().items():
        if dest in args:
            value = convert(getattr(args, dest))
            if section == "speculative" and field in from_json and from_json[field] != value:
                raise ValueError(f"--speculative-config sets {field}={from_json[field]!r} but "
                                 f"a --speculative-* flag sets it to {value!r}; give it once")
            sections.setdefault(section, {})[field] = value
    if not sections["speculative"]:
        del sections["speculative"]
    return sections


def api_key(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """--api-key, else DEEPINFER_API_KEY; None (no authentication) when neither is given.

    Raises:
        ValueError: the key given is empty or blank (almost surely an unfilled secret, which
            would silently serve an open API).
    """
    from deepinfer.engine.config import server_env

    key = args.api_key if args.api_key is not None else server_env(environ).get("api_key")
    if key is not None and not key.strip():
        source = "--api-key" if args.api_key is not None else "DEEPINFER_API_KEY"
        raise ValueError(f"{source} is set but empty; give the key, or leave it unset to "
                         "serve without authentication")
    return key


def api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None
             ) -> tuple[str, ...]:
    """Every accepted key: `api_key(...)` plus the lines of --api-key-file.

    Raises:
        ValueError: the file cannot be read or holds no key.
    """
    keys = [key] if (key := api_key(args, environ)) is not None else []
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {path}: {exc.strerror or exc}; give a readable "
                             "file with one key per line") from None
        found = [line.strip() for line in lines if line.strip() and
                 not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {path} holds no key; put one key per line")
        keys.extend(found)
    return tuple(keys)


def build_engine_config(args: argparse.Namespace, environ: dict[str, str] | None = None):
    """The engine config of the environment and the flags (a bad value from a variable is
    reported naming the variable)."""
    from deepinfer.engine.config import config_from, engine_flags

    given = {key[:2] for dest, key in engine_flags().items() if dest in args}
    return config_from(engine_sections(args, environ), environ, given)


def _check_listen_address(host: str, port: int) -> None:
    """Fail before the (long) model load when the port cannot be bound.

    Raises:
        ValueError: the port is out of range or the address is taken or not local.
    """
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another "
                         "--port or --host") from None


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _serve_encoder(config: Any, args: argparse.Namespace, key: Any, limits: Any) -> int:
    """`--role encoder`: only the vision tower, behind POST /v1/encode (server.encoder_app)."""
    try:
        from deepinfer.engine.mm_worker import EncoderWorker
        from deepinfer.server.encoder_app import build_encoder_app

        worker = EncoderWorker(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"deepinfer: cannot start the encoder worker: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        app = build_encoder_app(worker, config.multimodal, api_key=key, limits=limits)
        asyncio.run(serve_http(app, args))
    finally:
        worker.shutdown()
    print("deepinfer: stopped", flush=True)
    return 0


def _serve_headless(config: Any, args: argparse.Namespace) -> int:
    """This node's ranks only (engine/dp_node.py): node 0 serves the API."""
    if not args.headless or config.parallel.node_rank == 0:
        print(f"deepinfer: invalid configuration: node_rank={config.parallel.node_rank} "
              f"{'with' if args.headless else 'without'} --headless; node 0 serves the API "
              "(no --headless), every other node runs --headless.", file=sys.stderr)
        return 2
    from deepinfer.engine.dp_node import run_headless

    return run_headless(config)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_engine_config(args)
        key = api_keys(args)
        limits = limits_from_args(args)
        if config.frontend.api_server_count > 1 and config.kv_transfer.role == "encoder":
            raise ValueError(f"--api-server-count {config.frontend.api_server_count} does not "
                             "apply to --role encoder (no engine core); drop it")
        given = [flag for flag, dest in (("--num-speculative-tokens", "num_speculative_tokens"),
                                         ("--speculative-model", "speculative_model"),
                                         ("--[no-]spec-varlen", "spec_varlen"))
                 if hasattr(args, dest)]
        if given and not config.speculative.enabled:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                             "only with speculative decoding on; add --speculative-method "
                             "ngram|mtp|draft_model (or drop them)")
        if args.graceful_shutdown_s < 0:
            raise ValueError(f"--graceful-shutdown-s {args.graceful_shutdown_s} must be >= 0")
        if not args.headless:   # a headless node serves no HTTP
            _check_listen_address(args.host, args.port)   # last: the flags' own errors first
    except ValueError as exc:
        print(f"deepinfer: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.headless or config.parallel.node_rank > 0:
        return _serve_headless(config, args)
    print(f"deepinfer: API key {'required on /v1 routes' if key else 'not set: the API is open'}",
          flush=True)
    # SIGTERM while loading (a pod deleted during a long load) exits at once with 143; the
    # default disposition would be ignored where the server runs as a container's PID 1.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    print(f"deepinfer: loading {config.model.model or 'the embedded default model'}", flush=True)
    if config.kv_transfer.role == "encoder":
        return _serve_encoder(config, args, key, limits)
    if config.frontend.api_server_count > 1:
        from deepinfer.server.api_servers import serve_api_servers

        return serve_api_servers(config, args, key, limits)
    try:
        from deepinfer.engine.async_llm import AsyncLLM, freeze_startup_heap
        from deepinfer.server.app import build_app

        engine = AsyncLLM(config)
    except (FileNotFoundError, ValueError) as exc:   # no model, no tokenizer, unsupported arch
        print(f"deepinfer: cannot load the model: {exc}", file=sys.stderr)
        return 2
    except SystemExit:
        print("deepinfer: stopped while loading", flush=True)
        raise
    # uvicorn handles SIGTERM/SIGINT while serving (stop accepting, drain), then re-raises the
    # signal it caught; these no-op handlers receive it so that the engine is shut down below
    # instead of the process dying mid-cleanup.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    app = build_app(engine, api_key=key, cache_isolation=args.cache_isolation, limits=limits,
                    media=config.multimodal)
    freeze_startup_heap()   # no collector pauses over the startup heap while serving
    try:
        asyncio.run(serve_http(app, args))
    finally:
        engine.shutdown()
    print("deepinfer: stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:  # the router never imports torch or the engine
        from deepinfer.router.cli import main as router_main

        return router_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse refuses others


if __name__ == "__main__":
    sys.exit(main())
