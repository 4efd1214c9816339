"""deepinfer: an OpenAI-compatible serving stack for DeepSeek-style LLMs.

`from deepinfer import LLM, SamplingParams` (offline), `AsyncLLM` (online), `EngineConfig`.
The repository keeps its top-level directories (engine/, kernels/, kvstore/, server/, router/);
they install as `deepinfer.engine`, `deepinfer.kernels`, ... (pyproject.toml's package-dir).

Light on purpose: importing `deepinfer` imports no torch; the heavy classes load on first use.
"""

import os
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "engine" / "__init__.py").is_file() and (_CHECKOUT / "pyproject.toml").is_file():
    # A source checkout: the subpackages sit beside this folder, not inside it (an editable
    # install maps them too; a checkout that is not installed, as on the GPU machine, needs this).
    __path__.append(str(_CHECKOUT))  # noqa: F821 (a package's __path__)
    # With the checkout's root first on sys.path (`python -m` or pytest started there), its
    # kernels/ and server/ directories would shadow distributions of those names (HF's
    # `kernels`, which transformers >= 5.25 imports): the root moves to the end.
    _first = [p for p in sys.path if Path(os.path.abspath(p or ".")) == _CHECKOUT]
    if _first:
        sys.path[:] = [p for p in sys.path if p not in _first] + _first[:1]

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    if name in __all__:
        from deepinfer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
