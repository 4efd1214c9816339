"""The C++ extension cache (kernels/cpu_extension.py): one build per machine whatever the launch.

Issue 27 item 5: `make serve` (the venv's ninja first on PATH) and `.venv/bin/deepinfer` (the
system's ninja) rebuilt each other's objects, and without a system ninja the build failed. Each
case runs in a fresh Python process with its own PATH, building a tiny extension (plain Python C
API, compiles in a second) through the same `build_or_load` the CPU kernels use.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.kernels.cpu_extension import build_key

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")

TINY = r"""
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""},
                                {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tiny_ext", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_tiny_ext(void) { return PyModule_Create(&module); }
"""

BUILD = """
import json, sys
from pathlib import Path
from deepinfer.kernels.cpu_extension import build_or_load
csrc, root = Path(sys.argv[1]), Path(sys.argv[2])
module = build_or_load("tiny_ext", csrc, ["tiny.cpp"], root, ["-DANSWER=42"])
print(json.dumps({"answer": module.answer(), "file": module.__file__}))
"""


def write_sources(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "tiny.cpp").write_text(TINY)
    return directory


def build_in_process(csrc: Path, root: Path, path: str) -> dict:
    env = {**os.environ, "PATH": path}
    done = subprocess.run([sys.executable, "-c", BUILD, str(csrc), str(root)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def objects(root: Path) -> dict[str, int]:
    """Every built file under `root` -> its mtime in ns (a rebuild changes them)."""
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file() and p.suffix in (".o", ".so")}


def without_ninja(tmp_path: Path) -> str:
    """A PATH like the system's with no ninja on it: /usr/bin's tools linked one by one."""
    bin_dir = tmp_path / "system-bin-without-ninja"
    bin_dir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name != "ninja":
            (bin_dir / tool.name).symlink_to(tool)
    return str(bin_dir)


@pytest.mark.slow   # starts processes that compile
def test_two_launch_styles_share_one_build(tmp_path):
    csrc, root = write_sources(tmp_path / "csrc"), tmp_path / "extensions"
    venv_first = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    first = build_in_process(csrc, root, venv_first)             # as `make serve`
    built = objects(root)
    assert first["answer"] == 42 and any(name.endswith(".o") for name in built)
    second = build_in_process(csrc, root, "/usr/local/bin:/usr/bin:/bin")  # as .venv/bin/x
    assert second == first and objects(root) == built            # reused, nothing rebuilt
    third = build_in_process(csrc, root, without_ninja(tmp_path))
    assert third == first and objects(root) == built


@pytest.mark.slow   # starts processes that compile
def test_no_system_ninja_still_builds(tmp_path):
    csrc, root = write_sources(tmp_path / "csrc"), tmp_path / "extensions"
    built = build_in_process(csrc, root, without_ninja(tmp_path))
    assert built["answer"] == 42 and Path(built["file"]).parent.parent == root


def test_the_key_is_what_changes_the_object(tmp_path):
    one, two = write_sources(tmp_path / "a" / "csrc"), write_sources(tmp_path / "b" / "csrc")
    assert build_key(one, ["-O3"], []) == build_key(two, ["-O3"], [])   # another checkout
    assert build_key(one, ["-O3"], []) != build_key(one, ["-O2"], [])
    (two / "tiny.cpp").write_text(TINY.replace("ANSWER", "ANSWER + 1"))
    assert build_key(one, ["-O3"], []) != build_key(two, ["-O3"], [])


FAIL = """
import sys
from pathlib import Path
from deepinfer.kernels.cpu_extension import ExtensionBuildError, build_or_load
try:
    build_or_load("tiny_ext", Path(sys.argv[1]), ["tiny.cpp"], Path(sys.argv[2]), ["-DANSWER=1"])
except ExtensionBuildError as error:
    print(error)
"""


@pytest.mark.slow   # starts processes that compile
def test_a_failed_build_says_what_was_missing(tmp_path):
    csrc, root = write_sources(tmp_path / "csrc"), tmp_path / "extensions"
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-c", FAIL, str(csrc), str(root)],
                          env={**os.environ, "PATH": str(empty)}, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.startswith("no C++ compiler: `c++` is not on PATH"), done.stdout
    (csrc / "tiny.cpp").write_text(TINY.replace("ANSWER", "NOT_DEFINED_ANYWHERE"))
    done = subprocess.run([sys.executable, "-c", FAIL, str(csrc), str(root)],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("the compiler failed: ") and "NOT_DEFINED_ANYWHERE" in done.stdout


def test_no_ninja_anywhere_names_the_package(monkeypatch):
    from deepinfer.kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "packaged_ninja", lambda: None)
    monkeypatch.setattr(cpu_extension.shutil, "which", lambda name: None)
    why = cpu_extension._why(RuntimeError("Ninja is required to load C++ extensions"))
    assert why.startswith("no ninja: the `ninja` package is missing") and "pip install ninja" in why
