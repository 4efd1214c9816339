"""docker/warm_cache.py --check, the worker images' proof that nothing is redone at start: it
passes where the embedded model is already converted and fails (exit 1, saying why) where the
cache is cold. The C++ kernel half is left out here (a cold build takes about a minute)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from docker_files import ROOT


def _check(cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "docker/warm_cache.py", "--check", "--no-cpu-kernels"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_check_passes_on_a_warm_cache(smollm2_dir):
    result = _check(smollm2_dir.parent)
    assert result.returncode == 0, result.stderr
    assert f"warm_cache: model {smollm2_dir}" in result.stdout


@pytest.mark.slow
def test_check_fails_on_a_cold_cache(tmp_path):
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "the model was converted again" in result.stderr
