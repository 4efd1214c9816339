"""`deepinfer serve --engine-process`: the engine core in its own process behind the HTTP
server. A stream works, engine-side metrics reach /metrics, and a killed core process turns
into 503 `engine_dead` answers (never a hang)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import ServerProcess, deepinfer, metric
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn that is not its
    resource tracker."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"no engine core process among {children}")


def test_engine_process_serves_reports_metrics_and_fails_fast_when_killed(tmp_path,
                                                                           smollm2_tokenizer):
    model_dir = save_tiny_llama(tmp_path / "tiny", smollm2_tokenizer)   # quick to load
    server = ServerProcess("server", deepinfer(
        "serve", str(model_dir), "--device", "cpu", "--engine-process", "--max-num-seqs", "4",
        "--num-kv-blocks", "256"), tmp_path / "server.log")
    try:
        server.wait_ready(300)
        body = {"model": httpx.get(server.url + "/v1/models").json()["data"][0]["id"],
                "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 12
        text = "".join(c["text"] for e in events[:-2] for c in json.loads(e)["choices"])
        plain = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={**body, "stream": False, "stream_options": None}).json()
        assert text == plain["choices"][0]["text"] and text
        # engine-side counters come from the core process's stats messages
        deadline = time.monotonic() + 5
        while metric(server.url, "deepinfer:prefix_cache_queries_total") == 0:
            assert time.monotonic() < deadline, "engine stats never reached /metrics"
            time.sleep(0.1)
        os.kill(_core_pid(server.proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the core died"
            time.sleep(0.1)
        answer = httpx.post(server.url + "/v1/completions", timeout=30,
                            json={**body, "stream": False, "stream_options": None})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_dead"
    finally:
        server.kill()
