"""`make install` (run by `make serve` / `make test` on a fresh machine) says where it is: a line
per stage, and pip's progress on the two big installs (issue 27 item 6: over a minute of
silence looked like a hang)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_first_install_shows_its_stages(tmp_path):
    venv = tmp_path / "venv"   # absent, so make plans the whole install (-n: runs nothing)
    plan = subprocess.run(["make", "-n", "install", f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    stages = [line for line in plan if line.startswith("echo \"[")]
    assert [line[6:11] for line in stages] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    installs = [line for line in plan if " install " in line and "pip" in line]
    big = [line for line in installs if "torch==" in line or "'.[test]'" in line]
    assert len(big) == 2 and not any(" -q " in line for line in big)
