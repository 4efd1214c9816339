"""Shared fixtures. `smollm2_dir`: the embedded SmolLM2 GGUF converted to an HF directory.

The conversion lands in the default cache (~/.cache/deepinfer), so it happens once per machine
and later sessions reuse it in milliseconds.
"""

from pathlib import Path

import pytest

# first: sets MKL_DYNAMIC before any test module loads torch, and (deepinfer/__init__.py) moves
# the repository's root, where `python -m pytest` puts it, to the end of sys.path
import deepinfer.engine  # noqa: F401

TESTS = Path(__file__).resolve().parent


# `pytest -m gpu`: the tiers, in this order, so that a device call cut short has run the engine
# and server first (what a user runs), the kernel tests (hundreds of cases) after
GPU_TIERS = ("engine", "server", "e2e", "router", "kvstore", "deploy", "docker", "kernels")


def _gpu_tier(item) -> int:
    """The tier of `item` by its directory under tests/ (unlisted: before the kernels)."""
    parts = Path(str(item.path)).relative_to(TESTS).parts
    folder = parts[0] if len(parts) > 1 else ""
    return GPU_TIERS.index(folder) if folder in GPU_TIERS else GPU_TIERS.index("kernels") - 1


def pytest_collection_modifyitems(config, items):
    """With a marker expression naming `gpu`, run the tests tier by tier (`GPU_TIERS`);
    within a tier, in collection order (a stable sort)."""
    if "gpu" in (config.getoption("markexpr") or ""):
        items.sort(key=_gpu_tier)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF-format directory of SmolLM2-135M-Instruct (float32 safetensors, tokenizer, configs)."""
    from deepinfer.engine.loader import resolve_model_dir

    return resolve_model_dir(None, None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The SmolLM2 tokenizer (byte-level BPE with a chat template), from the converted dir."""
    from deepinfer.engine.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture
def torch_single_thread():
    """Run the test's torch ops on one thread (restored after). The intra-op pool of a 2-core
    CI box stalls badly when other processes hold a core; these tests measure values, not
    speed."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class RedisServer:
    """A private `redis-server` on a free localhost port (no persistence), for tests.

    `url` is fixed for the object's life; `stop()` kills the process (to test the store being
    down) and `start()` brings a fresh, empty one back on the same port.
    """

    def __init__(self, extra_args: tuple[str, ...] = ()) -> None:
        from tests.processes import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra_args = list(extra_args)   # e.g. a deployment's own flags (later ones win)
        self.process = None

    def start(self) -> "RedisServer":
        import shutil
        import socket
        import subprocess
        import time

        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (password set)
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture
def redis_server():
    """A fresh private redis-server for one test (see `RedisServer`); killed afterwards."""
    import shutil

    if not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url():
    """URL of a redis-server shared by the whole session; use keys of your own (flush
    nothing others need)."""
    import shutil

    if not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer().start()
    yield server.url
    server.stop()
