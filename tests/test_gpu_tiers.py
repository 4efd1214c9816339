"""`pytest -m gpu` runs the engine and server tests first, the kernel tests last
(tests/conftest.py `pytest_collection_modifyitems`)."""

from pathlib import Path
from types import SimpleNamespace

from tests import conftest  # the root one: a bare `conftest` may be a subfolder's

TESTS = Path(conftest.__file__).resolve().parent


def _items(*paths):
    return [SimpleNamespace(path=TESTS / path, name=path) for path in paths]


def _ordered(markexpr, items):
    config = SimpleNamespace(getoption=lambda name: markexpr)
    conftest.pytest_collection_modifyitems(config, items)
    return [item.name for item in items]


def test_gpu_runs_order_engine_and_server_before_kernels_stably():
    items = _items("kernels/test_pdl.py", "engine/test_gpu_engine.py", "kernels/test_a.py",
                   "e2e/test_gpu_server.py", "test_top_level.py", "engine/test_gpu_b.py")
    assert _ordered("gpu", items) == [
        "engine/test_gpu_engine.py", "engine/test_gpu_b.py", "e2e/test_gpu_server.py",
        "test_top_level.py", "kernels/test_pdl.py", "kernels/test_a.py"]


def test_other_runs_keep_the_collection_order():
    names = ["kernels/test_pdl.py", "engine/test_config.py"]
    assert _ordered("", _items(*names)) == names
    assert _ordered("not slow", _items(*names)) == names
