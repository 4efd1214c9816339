"""Importing `engine` turns MKL's load-dependent thread count off, unless the environment
sets MKL_DYNAMIC (engine/__init__.py)."""

import os
import subprocess
import sys

import pytest

PRINT = "import os, deepinfer.engine; print(os.environ['MKL_DYNAMIC'])"


@pytest.mark.parametrize("given, expected", [(None, "FALSE"), ("TRUE", "TRUE")])
def test_engine_import_sets_mkl_dynamic_unless_given(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "MKL_DYNAMIC"}
    if given is not None:
        env["MKL_DYNAMIC"] = given
    out = subprocess.run([sys.executable, "-c", PRINT], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == expected
