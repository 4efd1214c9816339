"""The router image's contents run the router, with no torch: the nearest thing to building
docker/router.Dockerfile without a Docker engine.

A fresh venv (no system site-packages) gets docker/router-requirements.txt, then `--no-deps` the
project files that the Dockerfile COPYs from the context, as the image does. In it, torch cannot
be imported, `deepinfer router --help` works, and `deepinfer router --backend URL` (a URL where
nothing listens) starts and answers GET /health (503: no live worker, which proves it serves).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import pytest
from docker_files import DOCKERFILES, ROOT, copy_sources, parse_dockerfile

from tests.processes import ServerProcess, free_port


def _install_router_image_contents(tmp_path):
    """A venv holding what docker/router.Dockerfile installs; its bin/ folder."""
    source = tmp_path / "context"
    for path in copy_sources(parse_dockerfile(DOCKERFILES["router"])):
        if (ROOT / path).is_dir():
            shutil.copytree(ROOT / path, source / path,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in (["-r", str(source / "docker/router-requirements.txt")],
                 ["--no-deps", str(source)]):
        result = subprocess.run(pip + args, capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
    return venv / "bin"


def _wait_for_health(server: ServerProcess, timeout_s: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"router exited:\n{server.log()}"
        try:
            return httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"router did not answer in {timeout_s}s:\n{server.log()}")


@pytest.mark.slow
def test_router_runs_from_its_image_contents_without_torch(tmp_path):
    bin_dir = _install_router_image_contents(tmp_path)
    no_torch = subprocess.run([bin_dir / "python", "-c", "import torch"], cwd=tmp_path,
                              capture_output=True, text=True)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    where = subprocess.run([bin_dir / "python", "-c", "import deepinfer.router as r; print(r.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(tmp_path / "venv"))
    help_text = subprocess.run([bin_dir / "deepinfer", "router", "--help"], cwd=tmp_path,
                               capture_output=True, text=True, check=True).stdout
    assert "--backend" in help_text

    dead_worker = f"http://127.0.0.1:{free_port()}"
    server = ServerProcess("router", lambda port: [
        str(bin_dir / "deepinfer"), "router", "--port", str(port), "--backend", dead_worker],
        tmp_path / "router.log", env={"PYTHONPATH": ""})  # the venv's code only
    try:
        assert _wait_for_health(server).status_code in (200, 503)
    finally:
        server.kill()
