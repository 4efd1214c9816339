"""`deepinfer router`: dispatched before the engine loads, never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.router.cli import build_parser, config_from_args, main

ROOT = Path(__file__).resolve().parents[2]


def test_router_help_does_not_import_torch_or_the_engine():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "deepinfer.server.cli", "router",
                             "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--prefill URL" in result.stdout and "prefix_affinity" in result.stdout
    imported = {line.split("|")[-1].strip()
                for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "deepinfer.router.cli" in imported
    forbidden = ("torch", "numpy", "transformers", "deepinfer.engine", "deepinfer.kernels")
    assert not [m for m in imported if m.startswith(forbidden)]


def test_app_import_does_not_import_torch():
    code = ("import sys, deepinfer.router.app, deepinfer.router.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') "
            "or m.startswith(('deepinfer.engine', 'deepinfer.kernels'))]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_flags_become_the_config():
    args = build_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:1",
                                      "--decode", "http://d:2", "--policy", "round_robin",
                                      "--health-interval-s", "0.5", "--max-imbalance", "2"])
    config = config_from_args(args)
    assert config.disaggregated and config.decode == ("http://d:1", "http://d:2")
    assert (config.policy, config.health_interval_s, config.max_imbalance) == \
        ("round_robin", 0.5, 2)


@pytest.mark.parametrize("argv, message", [
    ([], "no workers"),
    (["--backend", "http://a", "--prefill", "http://p"], "not both"),
    (["--backend", "http://a", "--max-concurrent-requests", "0"], "must be >= 1"),
    # one worker twice would double its duplicate-labelled metrics series
    (["--backend", "http://a:1", "--backend", "http://a:1/"],
     "--backend http://a:1 is given twice"),
    (["--backend", "http://:8000"], "has no host"),
    # the router adds /v1/...: a pasted OpenAI base URL would make it call /v1/v1/...
    (["--backend", "http://a:1/v1/"], "ends in /v1; give the worker's base URL (http://a:1)"),
    (["--prefill", "http://p:1", "--decode", "http://d:1/v1"], "ends in /v1"),
    (["--backend", "http://a:1/V1?x=1"], "ends in /v1; give the worker's base URL (http://a:1)"),
    (["--backend", "http://a:1/api/v1"], "base URL (http://a:1/api)"),
    (["--backend", "http://127.0.0.1:abc"], "has an invalid port"),
    (["--backend", "http://127.0.0.1:99999"], "has an invalid port"),
    (["--backend", "http://127.0.0.1:0"], "has an invalid port"),
    (["--backend", "http://a:1", "--graceful-shutdown-s", "-5"], "must be >= 0"),
    (["--backend", "http://a:1", "--port", "70000"], "is not a TCP port"),
])
def test_bad_flags_exit_2_with_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_taken_port_exits_2_before_starting(capsys):
    """Found by black-box testing: uvicorn's bind error (rc 3) came after the startup line
    and the replicas' admission."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["--backend", "http://127.0.0.1:1", "--port", str(port)]) == 2
    err = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in err.err and "pick another --port" in err.err
    assert "->" not in err.out   # the startup line was not printed


@pytest.mark.slow
@pytest.mark.parametrize("grace_s, finishes", [(30, True), (1, False)])
def test_sigterm_lets_relayed_streams_finish_within_the_grace(grace_s, finishes, tmp_path):
    """SIGTERM stops the router accepting; a stream in flight (about 3 s of events) runs to
    `[DONE]` within --graceful-shutdown-s. With a shorter grace the stream ends with a
    `router_shutting_down` error event and `[DONE]`, and a request still waiting for its
    worker's answer gets a 503 with that code; either way the router exits 0."""
    import json

    from tests.processes import ServerProcess, deepinfer, sigterm_during
    from tests.router.router_fakes import FakeWorker

    worker = FakeWorker("w").start()
    # slow: a stream of 150 events 20 ms apart; a JSON answer after 10 s
    worker.mode, worker.slow_events = "slow", 150
    router = ServerProcess("router", deepinfer(
        "router", "--backend", worker.url, "--graceful-shutdown-s", str(grace_s),
        "--log-level", "warning"), tmp_path / "router.log")
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        router.wait_ready(60)
        events, answer = sigterm_during(router, chat, plain=True, timeout_s=60,
                                        in_flight=lambda: len(worker.bodies) >= 2)
        assert router.proc.wait(timeout=60) == 0
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert ("error" not in last) is finishes, events[-3:]
        assert answer.status_code == (200 if finishes else 503)
        if not finishes:
            assert last["error"]["code"] == "router_shutting_down"
            assert answer.json()["error"]["code"] == "router_shutting_down"
        assert "deepinfer router: stopped" in router.log() and "Traceback" not in router.log()
    finally:
        router.kill()
        worker.stop()


def test_the_router_drops_idle_worker_connections_before_workers_close_them():
    """A request sent on a connection the worker is closing fails before its first byte and
    counts against a healthy replica; the router's pool expiry stays below the workers'
    keep-alive (and the router's own keep-alive above common load balancers' 60 s)."""
    from deepinfer.router.app import CLIENT_KEEP_ALIVE_S, WORKER_IDLE_EXPIRY_S, build_client
    from deepinfer.router.config import RouterConfig
    from deepinfer.server.cli import KEEP_ALIVE_S

    assert WORKER_IDLE_EXPIRY_S < KEEP_ALIVE_S and CLIENT_KEEP_ALIVE_S > 60
    client = build_client(RouterConfig(backends=("http://w:1",)))
    assert client._transport._pool._keepalive_expiry == WORKER_IDLE_EXPIRY_S
